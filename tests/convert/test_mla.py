"""DeepSeek-V2/V3 conversion: plans for a GPU target, MLA's absorbed matrices against vLLM's own
derivation, the KV-cache figure `kiln plan` prints, tensor-parallel shapes and skipped MTP layers.

The checkpoints are the tiny real ones of devtools/builders/moe.py (transformers-built, quantized by
llm-compressor); serving them against transformers is tests/runtime/test_moe.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from runtime.artifact.manifest import DERIVED_SCHEMA_VERSION
from runtime.mla import absorbed_name
from runtime.model_layout import ModelConfig, kv_cache_geometry
from services.convert.library import ConversionRequest, convert, plan
from tests.vllm_plugin.vllm_host import run_in_vllm, split_by_source, vllm_python

DEEPSEEK_SOURCES = [
    "deepseek_v3_bf16",
    "deepseek_v3_no_qlora_bf16",
    "deepseek_v2_lite_bf16",
    "deepseek_v3_gptq",
    "deepseek_v3_fp8_dynamic",
    "deepseek_v3_fp8_block",
]
# The tiny models: 3 layers, 4 heads of qk_nope 32 + rope 16, v 32, latent 128, bf16.
LATENT_BYTES_PER_TOKEN = 3 * (128 + 16) * 2
MHA_BYTES_PER_TOKEN = 3 * 4 * (48 + 32) * 2


def _plan(source: Path, target: str, **kw: Any) -> Any:
    return plan(str(source), target, **kw)


@pytest.mark.parametrize("fixture", DEEPSEEK_SOURCES)
def test_every_deepseek_source_plans_for_sm80_and_says_what_mla_caches(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    source: Path = request.getfixturevalue(fixture)
    plan = _plan(source, "sm80")
    rows = {row.layer: row for row in plan.rows}
    mla = plan.model.mla
    assert mla is not None
    for layer in range(plan.model.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        assert rows[absorbed_name(attn)].kernel == "mla_absorbed"
        assert f"{attn}.kv_b_proj" in rows and f"{attn}.o_proj" in rows
        q = f"{attn}.fused_qkv_a_proj" if mla.q_lora_rank else f"{attn}.kv_a_proj_with_mqa"
        assert q in rows
    note = next(n for n in plan.notes if n.startswith("MLA KV cache"))
    assert f"{LATENT_BYTES_PER_TOKEN:,} bytes per token" in note and f"{MHA_BYTES_PER_TOKEN:,}" in note
    geometry = kv_cache_geometry(plan.model)
    assert geometry.bytes_per_token(plan.model.num_layers, 2) == LATENT_BYTES_PER_TOKEN
    if fixture in ("deepseek_v3_bf16", "deepseek_v3_no_qlora_bf16"):  # their sources carry MTP tensors
        assert any("multi-token prediction" in n for n in plan.notes)
        assert not any(name.startswith("model.layers.3.") for name in plan.other_tensors)


def test_tensor_parallel_splits_heads_and_replicates_the_latent(deepseek_v3_bf16: Path) -> None:
    plan = _plan(deepseek_v3_bf16, "cpu", tp=2)
    rows = {row.layer: row for row in plan.rows}
    attn = "model.layers.1.self_attn"
    assert rows[f"{attn}.fused_qkv_a_proj"].n == 128 + 128 + 16  # q_a | latent | rope key, whole
    assert rows[f"{attn}.q_b_proj"].n == 2 * 48  # 2 of 4 heads
    assert rows[f"{attn}.kv_b_proj"].n == 2 * 64
    assert rows[f"{attn}.o_proj"].k == 2 * 32
    assert rows[absorbed_name(attn)].n == 2 * 64


def test_block_fp8_refuses_a_tp_that_splits_a_block(deepseek_v3_fp8_block: Path) -> None:
    """q_b_proj's 2 heads × 48 rows per rank are not whole 128-row blocks: refused, as vLLM does."""
    from kernels.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"q_b_proj: per-rank output features \[96\]"):
        _plan(deepseek_v3_fp8_block, "sm90", tp=2)


def test_model_config_reads_deepseek_routing(deepseek_v3_bf16: Path, deepseek_v2_lite_bf16: Path) -> None:
    import json

    v3 = ModelConfig.from_hf(json.loads((deepseek_v3_bf16 / "config.json").read_text()))
    assert v3.moe is not None and v3.mla is not None
    r = v3.moe.routing
    assert (r.scoring, r.groups, r.topk_groups, r.group_score, r.correction_bias, r.scaling) == (
        "sigmoid", 4, 2, "top2", True, 2.5,
    )  # fmt: skip
    assert v3.moe.dense_layers == frozenset({0}) and v3.moe.shared_expert_intermediate == 128
    assert v3.extra_layers == 1 and v3.rope_dim == 16
    v2 = ModelConfig.from_hf(json.loads((deepseek_v2_lite_bf16 / "config.json").read_text()))
    assert v2.moe is not None and v2.mla is not None and v2.mla.q_lora_rank is None
    assert (v2.moe.routing.scoring, v2.moe.routing.groups, v2.moe.routing.correction_bias) == (
        "softmax",
        1,
        False,
    )
    assert v2.moe.shared_expert_intermediate == 256 and not v2.moe.renormalize


# --- the absorbed matrices against vLLM's derivation ---------------------------------------------------

VLLM_SCRIPT = r"""
import sys
import torch
from torch import nn
from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj
from vllm.model_executor.layers.quantization.utils.quant_utils import scaled_dequantize

cases = torch.load(sys.argv[1], weights_only=True)
out = {}
for name, c in cases.items():
    layer = nn.Module()
    layer.quant_method = None  # an unquantized kv_b_proj: its weight cast to the act dtype
    if "weight_scale_inv" in c:  # block FP8 as vLLM dequantizes it without Marlin / DeepGEMM (fp32)
        w = scaled_dequantize(
            c["weight"], c["weight_scale_inv"], group_shape=[128, 128], out_dtype=torch.float32
        )
    else:
        w = c["weight"]
    layer.weight = nn.Parameter(w, requires_grad=False)
    w_uk, w_uv = split_kv_b_proj(layer, torch.bfloat16, c["L"], c["N"], c["P"], c["V"])
    # MLAAttention.process_weights_after_loading's layouts
    out[name] = {"W_UK_T": w_uk.permute(1, 2, 0).contiguous(), "W_UV": w_uv.transpose(0, 1).contiguous()}
torch.save(out, sys.argv[2])
"""


def _checkpoint_tensors(source: Path, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for path in source.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            out.update({n: f.get_tensor(n) for n in names if n in f.keys()})  # noqa: SIM118
    return out


def _artifact_tensors(artifact: Path, names: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(artifact / "rank0.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in names}


ABSORBED_SOURCES = ("deepseek_v3_bf16", "deepseek_v3_fp8_block")


@pytest.fixture(scope="module")
def vllm_absorbed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]:
    """Per source: (its sm80 artifact, vLLM's W_UK_T / W_UV of every layer's kv_b_proj), from one run
    of vLLM's venv for both sources."""
    vllm_python()  # skips without the venv, before any conversion
    work = tmp_path_factory.mktemp("vllm_absorbed")
    cases: dict[str, dict[str, Any]] = {}
    artifacts: dict[str, Path] = {}
    for fixture in ABSORBED_SOURCES:
        source: Path = request.getfixturevalue(fixture)
        (result,) = convert(ConversionRequest(str(source), ["sm80"], out=str(work / fixture)))
        manifest = result.manifest
        assert manifest.schema_version == DERIVED_SCHEMA_VERSION and len(manifest.derived) == 3
        artifacts[fixture] = work / fixture / manifest.artifact_id
        mla = ModelConfig.from_hf(manifest.hf_config).mla
        assert mla is not None
        for layer in range(3):
            module = f"model.layers.{layer}.self_attn.kv_b_proj"
            names = [f"{module}.weight", f"{module}.weight_scale_inv", f"{module}.weight_scale"]
            found = _checkpoint_tensors(source, names)
            case: dict[str, Any] = {"weight": found[f"{module}.weight"], "L": mla.kv_lora_rank, "N": 4,
                                    "P": mla.qk_nope_head_dim, "V": mla.v_head_dim}  # fmt: skip
            scale = found.get(f"{module}.weight_scale_inv", found.get(f"{module}.weight_scale"))
            if scale is not None:
                case["weight_scale_inv"] = scale.float()
            cases[f"{fixture}:{module}"] = case
    theirs = split_by_source(run_in_vllm(VLLM_SCRIPT, cases, work), ABSORBED_SOURCES)
    return {fixture: (artifacts[fixture], theirs[fixture]) for fixture in ABSORBED_SOURCES}


@pytest.mark.parametrize("fixture", ABSORBED_SOURCES)
def test_absorbed_matrices_are_vllms_split_kv_b_proj(
    fixture: str, vllm_absorbed: dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]
) -> None:
    """The sm80 artifact's W_UK_T / W_UV, byte for byte, against vLLM 0.32's `split_kv_b_proj` and
    the layouts its MLAAttention.process_weights_after_loading stores, run in vLLM's venv on the
    checkpoint's kv_b_proj. bf16: vLLM casts the weight to the act dtype. Block FP8: vLLM's fp32
    `scaled_dequantize` (its path without Marlin or DeepGEMM; on sm80 it dequantizes through the
    Marlin kernel instead, which rounds the block scales to bf16 first)."""
    artifact, theirs = vllm_absorbed[fixture]
    assert len(theirs) == 3
    for module, want in theirs.items():
        name = absorbed_name(module.removesuffix(".kv_b_proj"))
        ours = _artifact_tensors(artifact, [f"{name}.W_UK_T", f"{name}.W_UV"])
        for suffix in ("W_UK_T", "W_UV"):
            got = ours[f"{name}.{suffix}"]
            assert got.dtype == torch.bfloat16 and got.shape == want[suffix].shape, (name, suffix)
            assert torch.equal(got.view(torch.int16), want[suffix].view(torch.int16)), (name, suffix)


def test_an_artifact_without_its_absorbed_matrices_is_refused_at_load(
    deepseek_v3_bf16: Path, tmp_path: Path
) -> None:
    """A manifest that lost its derived section (an older converter's, or an edited one) is refused
    by name, before anything runs, instead of decoding with unbound matrices."""
    import json

    from runtime.load_errors import LoadError
    from runtime.loader import load_model

    (result,) = convert(ConversionRequest(str(deepseek_v3_bf16), ["cpu"], out=str(tmp_path / "out")))
    artifact = tmp_path / "out" / result.manifest.artifact_id
    manifest = json.loads((artifact / "manifest.json").read_text())
    del manifest["derived"]
    manifest["schema_version"] = 2
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        LoadError, match=r"no derived entry for model\.layers\.0\.self_attn\.kv_b_proj\.absorbed"
    ):
        load_model(artifact, with_tokenizer=False)
