"""Mixture-of-experts conversion: one plan row and one expert-group kernel per MoE layer, every
expert verified (exact for integer formats, the FP8 bound otherwise), TP / EP placement, bad input
refused naming the layer and expert with nothing left in the store.

Sources: real checkpoints (transformers-built Qwen3-MoE / Mixtral, quantized by llm-compressor for
real: GPTQ W4A16, FP8_DYNAMIC, FP8_BLOCK; devtools/builders/moe.py) and synthetic ones
written with every per-expert format (GPTQ v1/v2 sym/asym/act-order, AWQ-GEMM, compressed-tensors
pack-quantized, Fp8Config fp8; devtools/builders/synthetic.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from devtools.builders.synthetic import MIXTRAL_TINY, MOE_DEFECTS, QWEN3_MOE_TINY, Dims, write_checkpoint
from kernels.errors import KilnError
from kernels.fp8_w8a8 import Fp8W8A8Kernel
from kernels.registry import BUILTIN_KERNELS, get_moe_kernel
from runtime.artifact.manifest import Manifest
from runtime.model_layout import ModelConfig, expert_groups
from services.convert.checkpoint import open_checkpoint
from services.convert.detect import detect_format
from services.convert.errors import VerificationError
from services.convert.library import ConversionRequest, convert, plan
from services.convert.tp import fuse
from services.storage import open_source

QWEN3_GROUPS = ("model.layers.0.mlp.experts", "model.layers.2.mlp.experts")
# Synthetic per-expert checkpoints: name -> (format, dims, writer options)
SYNTHETIC: dict[str, tuple[str, Dims, dict[str, object]]] = {
    "qwen3moe-gptq-v1-sym": ("gptq", QWEN3_MOE_TINY, {}),
    "qwen3moe-gptq-v2-asym-actorder": ("gptq", QWEN3_MOE_TINY, {"v2": True, "sym": False, "act_order": True}),
    "qwen3moe-gptq-w8": ("gptq", QWEN3_MOE_TINY, {"bits": 8}),
    "qwen3moe-awq": ("awq", QWEN3_MOE_TINY, {}),
    "qwen3moe-ct-w4a16-asym": ("ct-pack", QWEN3_MOE_TINY, {"sym": False}),
    "qwen3moe-fp8-tensor": ("fp8", QWEN3_MOE_TINY, {}),
    "mixtral-gptq": ("gptq", MIXTRAL_TINY, {}),
    "mixtral-bf16": ("dense", MIXTRAL_TINY, {}),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-synthetic")
    out = {}
    for name, (fmt, dims, opts) in SYNTHETIC.items():
        out[name] = write_checkpoint(root / name, fmt, dims=dims, group_size=64, **opts)  # type: ignore[arg-type]
    return out


def _groups_ok(manifest: Manifest, kernel: str) -> None:
    # schema 3 when derived tensors (MLA's absorbed matrices) are there too
    assert manifest.schema_version == (3 if manifest.derived else 2) and manifest.verification.ok
    assert manifest.expert_groups, "no expert groups"
    for name, entry in manifest.expert_groups.items():
        assert entry.kernel == kernel, (name, entry.kernel)
        assert entry.verification is not None and entry.verification.ok, (name, entry.verification)


def _convert(source: Path, target: str, out: Path, **kw: object) -> Manifest:
    return convert(ConversionRequest(str(source), [target], out=str(out), **kw))[0].manifest  # type: ignore[arg-type]


# --- planning ------------------------------------------------------------------------------------


def test_plan_has_one_row_per_moe_layer(qwen3_moe_gptq: Path) -> None:
    p = plan(str(qwen3_moe_gptq), "sm80")
    rows = {r.layer: r for r in p.rows}
    for group in QWEN3_GROUPS:
        row = rows[group]
        assert row.kernel == "marlin_moe_wna16" and not row.fallback
        assert "8 experts × (w13 256×256, w2 256×128)" in row.scheme and "int4 g128 sym" in row.scheme
    assert rows["model.layers.0.mlp.gate"].kernel == "dense"  # the router stays dense
    assert rows["model.layers.1.mlp.gate_up_proj"].kernel == "marlin_wna16"  # the dense layer among MoE
    assert p.to_json()["fallbacks"] == 0


def test_a_layer_no_fused_kernel_takes_falls_back_and_says_so(qwen3_moe_odd_gptq: Path) -> None:
    """Experts of intermediate size 96: Marlin needs K % 128 for w2, so the per-expert GPTQ layout."""
    rows = {r.layer: r for r in plan(str(qwen3_moe_odd_gptq), "sm80").rows}
    row = rows["model.layers.0.mlp.experts"]
    assert row.fallback and row.kernel == "gptq_wna16_experts"
    reasons = dict(row.rejections)
    assert "K=96" in reasons["marlin_moe_wna16"] or "96" in reasons["marlin_moe_wna16"], reasons


# --- every source format x target ---------------------------------------------------------------

REAL_CELLS = [
    # (fixture, target, expected expert kernel)
    ("qwen3_moe_gptq", "cpu", "cpu_int4_experts"),
    ("qwen3_moe_gptq", "sm75", "gptq_wna16_experts"),
    ("qwen3_moe_gptq", "sm80", "marlin_moe_wna16"),
    ("qwen3_moe_gptq", "sm90", "marlin_moe_wna16"),
    ("qwen3_moe_fp8_dynamic", "cpu", "cpu_fp8_experts"),
    ("qwen3_moe_fp8_dynamic", "sm80", "fp8_marlin_moe"),
    ("qwen3_moe_fp8_dynamic", "sm90", "fp8_moe_w8a8"),
    ("qwen3_moe_fp8_block", "cpu", "cpu_fp8_experts"),
    ("qwen3_moe_fp8_block", "sm90", "fp8_moe_w8a16"),
    ("qwen3_moe_bf16", "cpu", "dense_experts"),
    ("qwen3_moe_bf16", "sm90", "dense_experts"),
    ("mixtral_gptq", "cpu", "cpu_int4_experts"),
    ("mixtral_gptq", "sm80", "marlin_moe_wna16"),
    ("mixtral_fp8_dynamic", "sm89", "fp8_moe_w8a8"),
    ("mixtral_fp8_block", "sm80", "fp8_marlin_moe"),
    ("mixtral_bf16", "cpu", "dense_experts"),
    ("qwen3_moe_odd_gptq", "cpu", "cpu_int4_experts"),
    ("qwen3_moe_odd_fp8_dynamic", "sm90", "fp8_moe_w8a8"),
    ("qwen2_moe_gptq", "cpu", "cpu_int4_experts"),
    ("qwen2_moe_gptq", "sm80", "marlin_moe_wna16"),
    ("qwen2_moe_fp8_dynamic", "sm90", "fp8_moe_w8a8"),
    ("qwen2_moe_fp8_dynamic", "sm80", "fp8_marlin_moe"),
    ("qwen2_moe_bf16", "cpu", "dense_experts"),
    ("deepseek_v3_gptq", "cpu", "cpu_int4_experts"),
    ("deepseek_v3_gptq", "sm80", "marlin_moe_wna16"),
    ("deepseek_v3_fp8_block", "sm80", "fp8_marlin_moe"),
    ("deepseek_v3_fp8_block", "sm90", "fp8_moe_w8a16"),
    ("deepseek_v3_fp8_dynamic", "sm90", "fp8_moe_w8a8"),
    ("deepseek_v2_lite_bf16", "sm80", "dense_experts"),
]


@pytest.mark.parametrize(("fixture", "target", "kernel"), REAL_CELLS)
def test_real_checkpoints_convert_and_verify_every_expert(
    request: pytest.FixtureRequest, tmp_path: Path, fixture: str, target: str, kernel: str
) -> None:
    _groups_ok(_convert(request.getfixturevalue(fixture), target, tmp_path / "out"), kernel)


@pytest.mark.parametrize(
    ("scheme", "target", "kernel"),
    [
        ("tensor", "cpu", "cpu_fp8_experts"),
        ("channel", "sm90", "fp8_moe_w8a8"),
        ("tensor", "sm80", "fp8_marlin_moe"),
        ("block", "sm90", "fp8_moe_w8a16"),
        ("block", "cpu", "cpu_fp8_experts"),
    ],
)
def test_bf16_experts_quantized_online_to_fp8(
    qwen3_moe_bf16: Path, tmp_path: Path, scheme: str, target: str, kernel: str
) -> None:
    m = _convert(qwen3_moe_bf16, target, tmp_path / "out", method="fp8", fp8_scheme=scheme)
    _groups_ok(m, kernel)
    assert m.layers["model.layers.0.mlp.gate"].kernel == "dense"  # routers are not quantized online


def test_online_fp8_requantizes_each_experts_w13_to_one_scale(qwen3_moe_bf16: Path, tmp_path: Path) -> None:
    """vLLM's Fp8MoEMethod: per-tensor FP8 experts carry ONE scale per expert for gate|up."""
    m = _convert(qwen3_moe_bf16, "sm90", tmp_path / "out", method="fp8", fp8_scheme="tensor")
    path = Path(m.files[0].name)
    artifact = tmp_path / "out" / m.artifact_id
    with safe_open(str(artifact / path), "pt") as f:
        scale = f.get_tensor("model.layers.0.mlp.experts.w13.weight_scale")
    assert tuple(scale.shape) == (8, 1)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_synthetic_per_expert_formats_convert_exactly(
    synthetic: dict[str, Path], tmp_path: Path, name: str, target: str
) -> None:
    fmt = SYNTHETIC[name][0]
    m = _convert(synthetic[name], target, tmp_path / "out")
    assert m.verification.ok and m.expert_groups
    for entry in m.expert_groups.values():
        assert entry.verification is not None and entry.verification.ok
        if fmt in ("gptq", "awq", "ct-pack") and target != "cpu":
            assert entry.verification.metric == "exact", (name, entry.verification)


# --- tensor and expert parallel ------------------------------------------------------------------


def test_tp_splits_every_expert_and_ep_places_whole_experts(
    qwen3_moe_fp8_dynamic: Path, tmp_path: Path
) -> None:
    # FP8 experts split over tp=2 on sm90 (GPTQ g128 with I=128 cannot: K/tp=64 breaks the group)
    tp = _convert(qwen3_moe_fp8_dynamic, "sm90", tmp_path / "tp", tp=2)
    ep = _convert(qwen3_moe_fp8_dynamic, "sm90", tmp_path / "ep", tp=2, expert_parallel=True)
    entry_tp, entry_ep = tp.expert_groups[QWEN3_GROUPS[0]], ep.expert_groups[QWEN3_GROUPS[0]]
    spec_tp, spec_ep = entry_tp.moe_spec(), entry_ep.moe_spec()
    assert (spec_tp.num_experts, spec_tp.w13.n, spec_tp.w2.k, spec_tp.w2.row_parallel) == (8, 128, 64, True)
    assert (spec_ep.num_experts, spec_ep.w13.n, spec_ep.w2.k, spec_ep.w2.row_parallel) == (4, 256, 128, False)
    assert (spec_ep.first_expert, spec_ep.total_experts) == (0, 8)
    assert ep.expert_parallel and ep.options == {"expert_parallel": True}
    assert ep.artifact_id != tp.artifact_id
    for m, entry, sub in ((tp, entry_tp, "tp"), (ep, entry_ep, "ep")):
        assert entry.verification is not None and entry.verification.ok
        stored = get_moe_kernel(entry.kernel).stored_tensors(entry.moe_spec(), m.target)  # same on every rank
        for rank in (0, 1):
            with safe_open(str(tmp_path / sub / m.artifact_id / f"rank{rank}.safetensors"), "pt") as f:
                for suffix, want in stored.items():
                    got = f.get_slice(f"{QWEN3_GROUPS[0]}.{suffix}").get_shape()
                    assert tuple(got) == want.shape, (suffix, got, want.shape)


def test_ep_needs_experts_divisible_by_ranks(tmp_path: Path) -> None:
    # heads split over 4 ranks, 6 experts do not
    dims = dataclasses.replace(QWEN3_MOE_TINY, num_experts=6, kv_heads=4)
    src = write_checkpoint(tmp_path / "src", "dense", dims=dims)
    with pytest.raises(KilnError, match="6 experts cannot be placed evenly on 4 ranks"):
        _convert(src, "cpu", tmp_path / "out", tp=4, expert_parallel=True)
    out = tmp_path / "out"
    assert not out.exists() or not any(p.name.startswith("ka-") for p in out.iterdir())


# --- bad input -----------------------------------------------------------------------------------

DEFECT_MESSAGES = {
    "missing-expert": "expert 7 is missing",
    "missing-expert-part": "expert 1",
    "unequal-experts": "expert 1's gate projection",
    "router-wrong-size": "model.layers.0.mlp.gate",
    "config-more-experts": "expert 8 is missing",
    "config-fewer-experts": "belongs to an expert the model config does not have",
    "partial-quant": "must be quantized alike",
    "partial-quant-unlisted": "model.layers.0.mlp.experts.0",
}


@pytest.mark.parametrize("defect", MOE_DEFECTS)
def test_bad_moe_checkpoints_are_refused_naming_layer_and_expert(tmp_path: Path, defect: str) -> None:
    fmt = "gptq" if defect.startswith("partial-quant") else "dense"
    src = write_checkpoint(tmp_path / "src", fmt, dims=QWEN3_MOE_TINY, group_size=64, defect=defect)
    out = tmp_path / "out"
    with pytest.raises(KilnError) as info:
        convert(ConversionRequest(str(src), ["cpu"], out=str(out)))
    message = str(info.value)
    assert DEFECT_MESSAGES[defect] in message, message
    assert "model.layers.0" in message, message
    leftovers = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert leftovers == [], leftovers  # nothing committed, nothing staged


@pytest.mark.parametrize("fixture", ["qwen3_moe_gptq", "qwen2_moe_gptq", "deepseek_v3_gptq"])
def test_expert_group_bytes_are_the_linear_kernels_per_expert(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Expert e's slice of the stacked tensors is what marlin_wna16 writes for that expert alone
    (so the group holds vLLM's per-expert Marlin repack, as gptq_marlin_moe_repack does), for each
    architecture's real llm-compressor experts."""
    source: Path = request.getfixturevalue(fixture)
    m = _convert(source, "sm80", tmp_path / "out")
    ckpt = open_checkpoint(open_source(str(source)))
    fmt = detect_format(ckpt)
    group = expert_groups(ModelConfig.from_hf(ckpt.config))[0]
    spec = m.expert_groups[group.name].moe_spec()
    marlin = BUILTIN_KERNELS["marlin_wna16"]
    with safe_open(str(tmp_path / "out" / m.artifact_id / "rank0.safetensors"), "pt") as f:
        stacked = {name: f.get_tensor(name) for name in f.keys() if name.startswith(group.name + ".")}  # noqa: SIM118
    for e in (0, group.num_experts - 1):
        layouts = (group.w13(e), group.w13(e), group.w2(e))
        modules = [group.module(e, part) for part in range(3)]
        quants = [fmt.layer_quant(mod, lay) for mod, lay in zip(modules, layouts, strict=True)]
        tensors = ckpt.read(
            [n for mod, q in zip(modules, quants, strict=True) for n in fmt.source_tensors(mod, q)]
        )
        gate, up, down = (fmt.decode(mod, q, tensors) for mod, q in zip(modules, quants, strict=True))
        per_expert = {
            "w13": marlin.prepare(fuse([gate, up], ["gate", "up"]), spec.w13, m.target),
            "w2": marlin.prepare(down, spec.w2, m.target),
        }
        for part, prepared in per_expert.items():
            for suffix, t in prepared.items():
                assert torch.equal(stacked[f"{group.name}.{part}.{suffix}"][e], t), (e, part, suffix)


# --- online FP8 verified from the quantizer's measured error -------------------------------------------


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_online_fp8_kept_as_quantized_is_verified_as_dequantizing_would(
    qwen3_moe_bf16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """sm90's fp8_w8a8 layouts store the quantizer's codes and scales as they are: each expert part
    and each linear layer is verified by those bytes plus the error measured while quantizing, and
    the manifest records the same figures as dequantizing the stored layer and comparing it with the
    source (the path every other layout takes, forced here by hiding the stored FP8 weights)."""
    measured = _convert(qwen3_moe_bf16, "sm90", tmp_path / "measured", method="fp8", fp8_scheme=scheme)
    monkeypatch.setattr(Fp8W8A8Kernel, "stored_fp8_weight", lambda self, tensors, spec: None)
    dequantized = _convert(qwen3_moe_bf16, "sm90", tmp_path / "dequantized", method="fp8", fp8_scheme=scheme)
    assert measured.artifact_id == dequantized.artifact_id
    for section in ("expert_groups", "layers"):
        for name, entry in getattr(measured, section).items():
            want = getattr(dequantized, section)[name].verification
            assert entry.verification == want, name
    worst = measured.expert_groups[QWEN3_GROUPS[0]].verification
    assert worst.metric == "max_rel_err" and 0 < worst.value <= worst.bound


def test_online_fp8_bytes_altered_after_quantizing_are_caught(
    qwen3_moe_bf16: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout that stores other codes than the quantizer's fails verification, naming the expert."""
    prepare = Fp8W8A8Kernel.prepare

    def altered(self: Fp8W8A8Kernel, weight: Any, spec: Any, target: Any) -> dict[str, torch.Tensor]:
        out = prepare(self, weight, spec, target)
        if spec.name.endswith("experts.w2"):
            codes = out["weight"].clone()
            codes.view(torch.uint8)[0, 0] ^= 0x01
            out["weight"] = codes
        return out

    monkeypatch.setattr(Fp8W8A8Kernel, "prepare", altered)
    where = r"expert group model\.layers\.0\.mlp\.experts \(rank 0, expert 0, w2"
    with pytest.raises(VerificationError, match=where):
        _convert(qwen3_moe_bf16, "sm90", tmp_path / "out", method="fp8", fp8_scheme="tensor")
