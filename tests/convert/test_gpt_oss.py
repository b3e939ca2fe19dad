"""gpt-oss conversion: the stacked expert sources read per expert, plans for sm80 and cpu, the sm80
expert groups against vLLM 0.32's own Marlin MXFP4 MoE preparation, and what is refused.

The checkpoints are devtools/builders/moe.py's tiny gpt-oss (transformers-built, bf16, experts
stacked as transformers saves them) and devtools/builders/gpt_oss.py's native-MXFP4 copy of it (the
stacked `*_blocks` / `*_scales` of OpenAI's release); serving them against transformers is
tests/runtime/test_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from kernels.base import Fp4Weight
from kernels.codecs.fp4 import unpack_fp4
from kernels.marlin_layout import marlin_permute_scales
from kernels.moe_base import SWIGLU_OAI, MoESpec
from kernels.registry import MOE_KERNELS
from runtime.artifact.manifest import Manifest
from runtime.model_layout import ModelConfig
from services.convert.library import ConversionRequest, convert, open_and_detect, plan
from services.convert.stacked_experts import StackedExpertsCheckpoint
from tests.vllm_plugin.vllm_host import MARLIN_REPACK_PRELUDE, run_in_vllm, split_by_source, vllm_python

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 256, 128
# Marlin group vs cpu_fp4 group on the same bf16 tokens: the same exact weights, outputs rounded to
# bf16 (2^-9) and summed in another order.
GROUP_REL_TOL = 1e-2
EXPERT_GROUPS = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]


def _stacked(source: Path, name: str) -> torch.Tensor:
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def test_the_config_reads_gpt_oss(gpt_oss_bf16: Path) -> None:
    cfg = ModelConfig.from_hf(json.loads((gpt_oss_bf16 / "config.json").read_text()))
    assert cfg.moe is not None
    assert (cfg.moe.activation, cfg.moe.swiglu_limit, cfg.moe.renormalize) == (SWIGLU_OAI, 7.0, True)
    assert cfg.window_layers == frozenset({0}) and cfg.sliding_window == 8
    assert (cfg.window(0), cfg.window(1)) == (8, None)
    assert cfg.attention_sinks and cfg.rope_scaling is not None and cfg.rope_scaling["truncate"] is False


@pytest.mark.parametrize("fixture", ["gpt_oss_bf16", "gpt_oss_mxfp4"])
def test_stacked_experts_read_as_per_expert_projections(fixture: str, request: pytest.FixtureRequest) -> None:
    """Expert e's gate / up / down (and biases) as the view serves them: the even and odd rows of its
    slice of the stacked gate_up tensors, and its down slice (transposed back for the bf16 x @ W)."""
    source: Path = request.getfixturevalue(fixture)
    ckpt, fmt = open_and_detect(str(source))
    assert isinstance(ckpt, StackedExpertsCheckpoint)
    stem = "model.layers.1.mlp.experts"
    assert not any(n.startswith(f"{stem}.gate_up_proj") for n in ckpt.tensors)
    e = 2
    bias = _stacked(source, f"{stem}.gate_up_proj_bias")[e]
    if fixture == "gpt_oss_bf16":
        assert fmt.name == "dense"
        got = ckpt.read([f"{stem}.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")])
        gate_up = _stacked(source, f"{stem}.gate_up_proj")[e].T  # (2I, H), interleaved rows
        assert torch.equal(got[f"{stem}.{e}.gate_proj.weight"], gate_up[0::2])
        assert torch.equal(got[f"{stem}.{e}.up_proj.weight"], gate_up[1::2])
        assert torch.equal(got[f"{stem}.{e}.down_proj.weight"], _stacked(source, f"{stem}.down_proj")[e].T)
    else:
        assert fmt.name == "gpt-oss-mxfp4"
        names = [f"{stem}.{e}.{p}.{s}" for p in ("gate_proj", "up_proj") for s in ("blocks", "scales")]
        got = ckpt.read(names)
        blocks = _stacked(source, f"{stem}.gate_up_proj_blocks")[e]
        scales = _stacked(source, f"{stem}.gate_up_proj_scales")[e]
        assert torch.equal(got[f"{stem}.{e}.gate_proj.blocks"], blocks[0::2])
        assert torch.equal(got[f"{stem}.{e}.up_proj.scales"], scales[1::2])
    read_bias = ckpt.read([f"{stem}.{e}.up_proj.bias"])[f"{stem}.{e}.up_proj.bias"]
    assert torch.equal(read_bias, bias[1::2])
    assert ckpt.total_bytes == sum(t.nbytes for t in ckpt.tensors.values())


@pytest.mark.parametrize(("fixture", "target", "method", "kernel"), [
    ("gpt_oss_mxfp4", "sm80", "auto", "marlin_fp4_experts"),
    ("gpt_oss_mxfp4", "sm90", "auto", "marlin_fp4_experts"),
    ("gpt_oss_mxfp4", "cpu", "auto", "cpu_fp4_experts"),
    ("gpt_oss_bf16", "sm80", "auto", "dense_experts"),
    ("gpt_oss_bf16", "sm80", "fp8", "fp8_marlin_experts"),
    ("gpt_oss_bf16", "sm90", "fp8", "fp8_w8a8_experts"),
    ("gpt_oss_bf16", "cpu", "auto", "dense_experts"),
])  # fmt: skip
def test_gpt_oss_plans(
    fixture: str, target: str, method: str, kernel: str, request: pytest.FixtureRequest
) -> None:
    """Experts through a per-expert kernel: the fused ones add no expert biases and say so; attention
    and router with their biases; the router is `mlp.router`; the sinks copied."""
    source: Path = request.getfixturevalue(fixture)
    p = plan(str(source), target, method=method)  # type: ignore[arg-type]
    rows = {row.layer: row for row in p.rows}
    for group in EXPERT_GROUPS:
        assert rows[group].kernel == kernel
        fused = [reason for _, reason in rows[group].rejections if "no expert biases" in reason]
        assert fused or method == "auto", rows[group].rejections
    assert "model.layers.0.mlp.router" in rows
    units = {u.name: u for u in p.units}
    spec: MoESpec = units[EXPERT_GROUPS[0]].specs[0]  # type: ignore[attr-defined]
    assert spec.activation == SWIGLU_OAI and spec.w13.has_bias and spec.w2.has_bias
    assert "model.layers.0.self_attn.sinks" in p.other_tensors


def test_the_cli_plans_gpt_oss_for_sm80(gpt_oss_mxfp4: Path) -> None:
    from typer.testing import CliRunner

    from services.cli import app

    res = CliRunner().invoke(app, ["plan", str(gpt_oss_mxfp4), "--target", "sm80", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["format"] == "gpt-oss-mxfp4"
    kernels = {row["layer"]: row["kernel"] for row in data["layers"]}
    assert all(kernels[group] == "marlin_fp4_experts" for group in EXPERT_GROUPS)


# --- sm80 expert groups against vLLM's Marlin MXFP4 MoE preparation ----------------------------------

# Runs in vLLM's venv: the checkpoint's stacked tensors as vLLM's gpt-oss loader places them (the
# blocks viewed (E, N, K/2), gate/up rows interleaved, copied into the top-left corner of its
# zero-initialised parameters padded to Marlin's multiples), prepared by
# `prepare_moe_mxfp4_layer_for_marlin` (the gpt-oss Marlin path). `gptq_marlin_repack` is CUDA-only:
# replaced by vLLM's own pure-Python test helper as tests/kernels/test_marlin_fp4.py does; the padded
# sizes are vLLM's own `mxfp4_round_up_hidden_size_and_intermediate_size` for its MARLIN backend.
VLLM_SCRIPT = (
    MARLIN_REPACK_PRELUDE
    + r"""
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
    Mxfp4MoeBackend, mxfp4_round_up_hidden_size_and_intermediate_size,
)
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as fp4


def placed(t, shape, dtype):
    param = torch.zeros(shape, dtype=dtype)
    param[tuple(slice(0, d) for d in t.shape)] = t
    return param


out = {}
for name, c in torch.load(sys.argv[1], weights_only=True).items():
    e, two_i, h2 = c["w13"].shape
    hp, ip = mxfp4_round_up_hidden_size_and_intermediate_size(Mxfp4MoeBackend.MARLIN, h2 * 2, two_i // 2)
    layer = types.SimpleNamespace(params_dtype=torch.bfloat16)
    w13, w2, s13, s2, b13, b2 = fp4.prepare_moe_mxfp4_layer_for_marlin(
        layer,
        placed(c["w13"], (e, 2 * ip, hp // 2), torch.uint8),
        placed(c["w2"], (e, hp, ip // 2), torch.uint8),
        placed(c["w13_scale"], (e, 2 * ip, hp // 32), torch.uint8),
        placed(c["w2_scale"], (e, hp, ip // 32), torch.uint8),
        placed(c["w13_bias"], (e, 2 * ip), torch.bfloat16),
        placed(c["w2_bias"], (e, hp), torch.bfloat16),
    )
    out[name] = {"w13.qweight": w13, "w2.qweight": w2, "w13.scales": s13, "w2.scales": s2,
                 "w13.bias": b13, "w2.bias": b2}
torch.save(out, sys.argv[2])
"""
)
# source fixture -> (H, I) of the model
MARLIN_SOURCES = {"gpt_oss_mxfp4": (HIDDEN, INTER), "gpt_oss_padded_mxfp4": (320, 96)}


@pytest.fixture(scope="module")
def sm80_and_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]:
    """Per source: (its sm80 artifact, vLLM's prepared tensors of every group), one vLLM run."""
    vllm_python()  # skips without the venv, before any conversion
    work = tmp_path_factory.mktemp("gpt_oss_sm80")
    cases: dict[str, dict[str, Any]] = {}
    artifacts: dict[str, Path] = {}
    for fixture, (h, i) in MARLIN_SOURCES.items():
        source: Path = request.getfixturevalue(fixture)
        (result,) = convert(ConversionRequest(str(source), ["sm80"], out=str(work / fixture)))
        artifacts[fixture] = work / fixture / result.manifest.artifact_id
        for group in EXPERT_GROUPS:
            t = {
                n: _stacked(source, f"{group}.{n}")
                for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                          "down_proj_blocks", "down_proj_scales", "down_proj_bias")
            }  # fmt: skip
            cases[f"{fixture}:{group}"] = {
                "w13": t["gate_up_proj_blocks"].reshape(EXPERTS, 2 * i, h // 2),
                "w2": t["down_proj_blocks"].reshape(EXPERTS, h, i // 2),
                "w13_scale": t["gate_up_proj_scales"],
                "w2_scale": t["down_proj_scales"],
                "w13_bias": t["gate_up_proj_bias"],
                "w2_bias": t["down_proj_bias"],
            }
    theirs = split_by_source(run_in_vllm(VLLM_SCRIPT, cases, work), list(MARLIN_SOURCES))
    return {fixture: (artifacts[fixture], theirs[fixture]) for fixture in MARLIN_SOURCES}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bytes (Kiln stores the E8M0 scale bytes as uint8, vLLM as float8_e8m0fnu)."""
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _group(artifact: Path, group: str) -> tuple[MoESpec, Any, dict[str, torch.Tensor]]:
    entry = Manifest.load(artifact).expert_groups[group]
    with safe_open(str(artifact / "rank0.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(f"{group}.{n}") for n in entry.tensors}
    return entry.moe_spec(), MOE_KERNELS[entry.kernel], tensors


@pytest.mark.parametrize("group", EXPERT_GROUPS)
@pytest.mark.parametrize("fixture", list(MARLIN_SOURCES))
def test_sm80_expert_groups_are_vllms_marlin_mxfp4_moe_bytes(
    fixture: str, group: str, sm80_and_vllm: dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]
) -> None:
    """Codes and scales byte for byte, gate/up rows interleaved and H / I zero-padded to Marlin's
    multiples as vLLM holds them; the biases are Kiln's natural column order, which vLLM's
    `marlin_permute_bias` turns into its own."""
    artifact, vllm = sm80_and_vllm[fixture]
    theirs = vllm[group]
    spec, _, ours = _group(artifact, group)
    h, i = MARLIN_SOURCES[fixture]
    assert (spec.model_hidden, spec.model_intermediate) == (h, i)
    assert (spec.hidden, spec.intermediate) == (-(-h // 256) * 256, -(-i // 128) * 128)
    for key in ("w13.qweight", "w2.qweight", "w13.scales", "w2.scales"):
        assert _same_bytes(ours[key], theirs[key]), key
    for key, n in (("w13.bias", spec.w13.n), ("w2.bias", spec.w2.n)):
        permuted = torch.stack([marlin_permute_scales(b[None], 1, n, -1)[0] for b in ours[key]])
        assert _same_bytes(permuted.to(theirs[key].dtype), theirs[key]), key


def test_sm80_experts_decode_to_the_checkpoint(
    sm80_and_vllm: dict[str, tuple[Path, Any]], gpt_oss_padded_mxfp4: Path
) -> None:
    """The manifest records the activation and the padding; dequantized expert 1's w13 is the
    checkpoint's interleaved rows exactly (E2M1 times E8M0: exact in fp32), zeros around them."""
    artifact, _ = sm80_and_vllm["gpt_oss_padded_mxfp4"]
    spec, kernel, tensors = _group(artifact, EXPERT_GROUPS[0])
    assert spec.activation == SWIGLU_OAI and spec.swiglu_limit == 7.0
    assert (spec.hidden_pad, spec.intermediate_pad) == (512 - 320, 128 - 96)
    w13, _ = kernel.dequantize_expert(tensors, spec, 1)
    blocks = _stacked(gpt_oss_padded_mxfp4, f"{EXPERT_GROUPS[0]}.gate_up_proj_blocks")[1]
    scales = _stacked(gpt_oss_padded_mxfp4, f"{EXPERT_GROUPS[0]}.gate_up_proj_scales")[1]
    want = Fp4Weight(unpack_fp4(blocks.reshape(2 * 96, -1)), scales, "mxfp4").dequantize()
    assert torch.equal(w13[: 2 * 96, :320], want)
    assert not w13[2 * 96 :].any() and not w13[:, 320:].any()


@torch.inference_mode()
def test_the_padded_sm80_group_computes_the_cpu_groups_output(
    sm80_and_vllm: dict[str, tuple[Path, Any]], gpt_oss_padded_mxfp4: Path, tmp_path: Path
) -> None:
    """The padded Marlin group (its pure-torch twin: activations padded, output cut back) against the
    cpu artifact's unpadded cpu_fp4_experts group on the same tokens and routing."""
    artifact, _ = sm80_and_vllm["gpt_oss_padded_mxfp4"]
    (result,) = convert(ConversionRequest(str(gpt_oss_padded_mxfp4), ["cpu"], out=str(tmp_path)))
    cpu_spec, cpu_kernel, cpu_tensors = _group(tmp_path / result.manifest.artifact_id, EXPERT_GROUPS[1])
    spec, kernel, tensors = _group(artifact, EXPERT_GROUPS[1])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 320, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(9)])
    weights = torch.softmax(torch.randn(9, 2, generator=gen), -1)
    got = kernel.reference(x, ids, weights, tensors, spec).float()
    want = cpu_kernel.apply(x, ids, weights, cpu_tensors, cpu_spec).float()
    assert got.shape == (9, 320)
    assert (got - want).norm() / want.norm() < GROUP_REL_TOL


# --- refusals ---------------------------------------------------------------------------------------


def test_an_unknown_stacked_tensor_is_named(gpt_oss_bf16: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from services.convert.errors import ConversionError

    copy = tmp_path / "ckpt"
    shutil.copytree(gpt_oss_bf16, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.gate_up_proj_extra"] = torch.zeros(EXPERTS, 2)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"model.layers.0.mlp.experts.gate_up_proj_extra: unknown kind"):
        plan(str(copy), "cpu")


def test_tp_ranks_hold_their_interleaved_rows_padded(gpt_oss_mxfp4: Path, tmp_path: Path) -> None:
    """tp=2 on sm80: each rank's I = 64 is padded to Marlin's 128. Rank r's w13 is the checkpoint's
    interleaved gate/up rows of its intermediate half (a contiguous run of the stacked rows, as vLLM
    slices them), then zero rows; its w2 the matching input columns, then zero columns."""
    (result,) = convert(ConversionRequest(str(gpt_oss_mxfp4), ["sm80"], out=str(tmp_path), tp=2))
    artifact = tmp_path / result.manifest.artifact_id
    group, h, i = EXPERT_GROUPS[0], HIDDEN, INTER // 2
    blocks = _stacked(gpt_oss_mxfp4, f"{group}.gate_up_proj_blocks")[1]
    scales = _stacked(gpt_oss_mxfp4, f"{group}.gate_up_proj_scales")[1]
    down_blocks = _stacked(gpt_oss_mxfp4, f"{group}.down_proj_blocks")[1]
    down_scales = _stacked(gpt_oss_mxfp4, f"{group}.down_proj_scales")[1]
    down = Fp4Weight(unpack_fp4(down_blocks.reshape(h, -1)), down_scales, "mxfp4").dequantize()  # (H, I)
    for rank in (0, 1):
        entry = Manifest.load(artifact).expert_groups[group]
        spec = entry.moe_spec()
        with safe_open(str(artifact / f"rank{rank}.safetensors"), "pt") as f:
            tensors = {n: f.get_tensor(f"{group}.{n}") for n in entry.tensors}
        assert (spec.model_intermediate, spec.intermediate, spec.hidden) == (i, 128, h)
        w13, w2 = MOE_KERNELS[entry.kernel].dequantize_expert(tensors, spec, 1)
        rows = slice(2 * i * rank, 2 * i * (rank + 1))
        want = Fp4Weight(unpack_fp4(blocks[rows].reshape(2 * i, -1)), scales[rows], "mxfp4").dequantize()
        assert torch.equal(w13[: 2 * i], want) and not w13[2 * i :].any()
        assert torch.equal(w2[:, :i], down[:, i * rank : i * (rank + 1)]) and not w2[:, i:].any()
