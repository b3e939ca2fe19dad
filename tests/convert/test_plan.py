"""Plans: which kernel every layer gets per target and TP size, ignore rules, fusing, fallbacks."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from devtools.builders.synthetic import TINY, write_checkpoint
from kernels.errors import UnsupportedError
from services.convert.library import plan

DECODER = "model.layers."
# checkpoint -> target -> kernel every quantized decoder-layer projection gets (tp 1 and 2)
EXPECTED: dict[str, dict[str, str]] = {
    "gptq-w4-v1-sym": {
        "sm80": "marlin_wna16",
        "sm90": "marlin_wna16",
        "cpu": "cpu_w4a8",
        "sm75": "gptq_wna16",
    },
    "gptq-w4-v2-asym": {"sm80": "marlin_wna16", "sm90": "marlin_wna16", "cpu": "cpu_w4a8"},
    "gptq-w4-v1-asym": {"sm80": "marlin_wna16", "cpu": "cpu_w4a8"},
    "gptq-w4-actorder": {"sm80": "marlin_wna16", "sm90": "marlin_wna16", "cpu": "cpu_int4"},
    "gptq-w8-sym": {"sm80": "marlin_wna16", "sm90": "marlin_wna16"},
    "gptq-w4-mislabeled-v2": {"sm80": "marlin_wna16", "cpu": "cpu_w4a8"},
    "awq-gemm": {"sm80": "marlin_wna16", "sm90": "marlin_wna16", "cpu": "cpu_w4a8", "sm75": "gptq_wna16"},
    "ct-w4a16-sym": {"sm80": "marlin_wna16", "sm90": "marlin_wna16", "cpu": "cpu_w4a8"},
    "ct-w4a16-asym": {"sm80": "marlin_wna16", "sm90": "marlin_wna16", "cpu": "cpu_w4a8"},
    "ct-w4a16-actorder": {"sm80": "marlin_wna16", "sm90": "marlin_wna16", "cpu": "cpu_int4"},
    "ct-w8a16": {"sm80": "marlin_wna16", "sm90": "marlin_wna16"},
    "ct-fp8-channel": {"sm80": "fp8_marlin", "sm90": "fp8_w8a8", "cpu": "cpu_fp8"},
    "ct-int8": {"sm80": "int8_w8a8", "sm90": "int8_w8a8", "cpu": "cpu_w8a8"},  # declares int8 activations
    "fp8-tensor": {"sm80": "fp8_marlin", "sm90": "fp8_w8a8", "cpu": "cpu_fp8"},
    "bf16": {"sm80": "dense", "sm90": "dense", "cpu": "dense"},
}

# A 4-bit checkpoint's cpu conversion takes int8 activations (cpu_w4a8, but for act-order layers) and an
# int8 head by default (services/convert/cpu_defaults.py); every other lm_head stays dense.
CPU_4BIT_HEAD = "cpu_int8"

# cpu_int4 refuses act-order on a row-parallel split (a rank would hold partial groups): those
# layers (o_proj, down_proj) fall to the dense fp32 path at tp 2.
ROW_PARALLEL_TP2 = {("gptq-w4-actorder", "cpu"): "dense", ("ct-w4a16-actorder", "cpu"): "dense"}


def _decoder_kernels(p) -> set[str]:  # type: ignore[no-untyped-def]
    return {r.kernel for r in p.rows if r.layer.startswith(DECODER)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_picks_expected_kernels(ckpt: Callable[[str], Path], name: str, tp: int) -> None:
    for target, kernel in EXPECTED[name].items():
        p = plan(str(ckpt(name)), target, tp=tp)
        row_kernel = ROW_PARALLEL_TP2.get((name, target), kernel) if tp == 2 else kernel
        for pl in p.units:
            if pl.name.startswith(DECODER):
                want = row_kernel if pl.layout.row_parallel else kernel
                assert pl.kernel.name == want, (target, pl.name, pl.rejected)
        lm = [r for r in p.rows if r.layer == "lm_head"]
        four_bit_cpu = target == "cpu" and kernel in ("cpu_w4a8", "cpu_int4")
        assert [r.kernel for r in lm] == [CPU_4BIT_HEAD if four_bit_cpu else "dense"]
        assert (lm[0].scheme == "dense") != four_bit_cpu
        assert not any(r.fallback for r in p.rows)
        assert "model.embed_tokens.weight" in p.other_tensors
        assert len(p.units[0].specs) == tp
        json.dumps(p.to_json())  # serializable


def test_plan_tp_shapes_per_rank(ckpt: Callable[[str], Path]) -> None:
    p = plan(str(ckpt("gptq-w4-v1-sym")), "sm80", tp=2)
    by_name = {pl.name: pl for pl in p.units}
    qkv = by_name["model.layers.0.self_attn.qkv_proj"].specs[1]
    # 4 heads / 2 kv heads, head_dim 64: per rank q 128, k 64, v 64
    assert (qkv.n, qkv.k, qkv.row_parallel) == (256, 256, False)
    assert [s.size for s in qkv.shards] == [128, 64, 64]
    o = by_name["model.layers.0.self_attn.o_proj"].specs[0]
    assert (o.n, o.k, o.k_full, o.row_parallel) == (256, 128, 256, True)
    down = by_name["model.layers.0.mlp.down_proj"].specs[1]
    assert (down.n, down.k, down.k_full) == (256, 256, 512)


def test_kv_heads_replicated_when_fewer_than_tp(ckpt: Callable[[str], Path]) -> None:
    p = plan(str(ckpt("bf16")), "cpu", tp=4)
    qkv = p.units[0].specs[3]
    assert [s.size for s in qkv.shards] == [64, 64, 64]  # 1 q head, the (replicated) kv head


def test_mislabeled_gptq_v2_is_detected_and_said(ckpt: Callable[[str], Path]) -> None:
    p = plan(str(ckpt("gptq-w4-mislabeled-v2")), "sm80")
    assert any("gptq_v2" in n and "0x88888888" in n for n in p.notes)
    assert "v2" in json.dumps(p.to_json()["notes"])


def test_marlin_shape_refusal_falls_back(tmp_path: Path) -> None:
    # down_proj K = intermediate 320: 320 % 128 != 0, so Marlin refuses it and gptq_wna16 takes it
    path = write_checkpoint(tmp_path / "odd", "gptq", dims=replace(TINY, intermediate=320), group_size=64)
    p = plan(str(path), "sm80")
    rows = {r.layer: r for r in p.rows}
    down = rows["model.layers.0.mlp.down_proj"]
    assert down.kernel == "gptq_wna16" and down.fallback
    assert any(k == "marlin_wna16" and "128" in why for k, why in down.rejections)
    assert rows["model.layers.0.self_attn.qkv_proj"].kernel == "marlin_wna16"
    assert not rows["model.layers.0.self_attn.qkv_proj"].fallback


def test_fp8_ignored_layers_are_exact_unfused_names(tmp_path: Path) -> None:
    ok = write_checkpoint(tmp_path / "ok", "fp8", ignore=["model.layers.1.mlp.down_proj"])
    rows = {r.layer: r for r in plan(str(ok), "sm90").rows}
    assert rows["model.layers.1.mlp.down_proj"].kernel == "dense"
    assert rows["model.layers.0.mlp.down_proj"].kernel == "fp8_w8a8"
    partial = write_checkpoint(tmp_path / "partial", "fp8", ignore=["model.layers.0.self_attn.k_proj"])
    with pytest.raises(UnsupportedError, match=r"qkv_proj.*k_proj: dense"):
        plan(str(partial), "sm90")


def test_awq_modules_to_not_convert_is_substring(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "awq", "awq", ignore=["model.layers.1.mlp.down_proj"])
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = [
        "1.mlp.down"
    ]  # a substring, as AutoAWQ users write
    (path / "config.json").write_text(json.dumps(cfg))
    rows = {r.layer: r for r in plan(str(path), "sm80").rows}
    assert rows["model.layers.1.mlp.down_proj"].kernel == "dense"
    assert rows["model.layers.0.mlp.down_proj"].kernel == "marlin_wna16"


def test_gptq_dynamic_rules_on_fused_names(tmp_path: Path) -> None:
    dynamic = {
        r"-:model\.layers\.1\.mlp\.gate_up_proj": {},
        r"+:model\.layers\.0\.self_attn\..*": {"bits": 4},
    }
    path = write_checkpoint(tmp_path / "dyn", "gptq", dynamic=dynamic)
    rows = {r.layer: r for r in plan(str(path), "sm80").rows}
    assert rows["model.layers.1.mlp.gate_up_proj"].kernel == "dense"
    assert rows["model.layers.1.mlp.gate_up_proj"].scheme == "dense"
    assert rows["model.layers.0.mlp.gate_up_proj"].kernel == "marlin_wna16"


def test_gptq_mixed_precision_across_layers(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "mixed", "gptq", bits=8)
    cfg = json.loads((path / "config.json").read_text())
    # layer 1's mlp is declared 8-bit via a dynamic override while the default is 4-bit: the stored
    # tensors are 8-bit everywhere, so mark everything except layer-1 mlp as 8-bit by override too
    cfg["quantization_config"]["bits"] = 4
    cfg["quantization_config"]["dynamic"] = {r"+:model\.layers\.\d+\..*": {"bits": 8}}
    (path / "config.json").write_text(json.dumps(cfg))
    p = plan(str(path), "sm80")
    assert {r.scheme for r in p.rows if r.layer.startswith(DECODER)} == {"int8 g128 sym"}


def test_ct_ignore_regex_and_class_targets(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ct", "ct-pack", ignore=["model.layers.0.mlp.down_proj"])
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", r"re:.*layers\.0\.mlp\.down_proj$"]
    (path / "config.json").write_text(json.dumps(cfg))
    rows = {r.layer: r for r in plan(str(path), "sm80").rows}
    assert rows["model.layers.0.mlp.down_proj"].kernel == "dense"
    assert rows["model.layers.1.mlp.down_proj"].kernel == "marlin_wna16"
    assert rows["lm_head"].kernel == "dense"  # class ParallelLMHead does not contain "Linear"


def test_online_fp8_plan(ckpt: Callable[[str], Path]) -> None:
    for target, kernel in {"sm90": "fp8_w8a8", "sm80": "fp8_marlin", "cpu": "cpu_fp8"}.items():
        for scheme in ("tensor", "channel", "block"):
            p = plan(str(ckpt("bf16")), target, method="fp8", fp8_scheme=scheme)
            want = "fp8_marlin" if (target, scheme) == ("sm90", "block") else kernel  # fp8_w8a8: no blocks
            assert _decoder_kernels(p) == {want}
            assert {r.scheme.split()[1] for r in p.rows if r.layer.startswith(DECODER)} == {scheme}
            assert p.to_json()["options"] == {"fp8_scheme": scheme}
            assert [r.kernel for r in p.rows if r.layer == "lm_head"] == ["dense"]


def test_act_dtype(ckpt: Callable[[str], Path]) -> None:
    assert plan(str(ckpt("bf16")), "sm80").act_dtype == "bfloat16"
    assert plan(str(ckpt("bf16")), "sm75").act_dtype == "float16"
    assert plan(str(ckpt("gptq-w4-v1-sym")), "sm80").act_dtype == "float16"


def test_static_activation_scales_are_dropped_with_a_note(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "static", "fp8", static_act=True)
    p = plan(str(path), "sm90")
    assert not any(n.endswith("input_scale") for n in p.other_tensors)
    assert any("input_scale" in n for n in p.notes) and any("activation_scheme static" in n for n in p.notes)
    assert {r.kernel for r in p.rows if r.layer != "lm_head"} == {"fp8_w8a8"}


@pytest.mark.parametrize(
    ("acts", "kernel", "note"),
    [
        ({"dynamic": True, "strategy": "token", "symmetric": True}, "cpu_w8a8", None),
        ({"dynamic": False, "strategy": "tensor", "symmetric": True}, "cpu_int8", "strategy tensor, static"),
        ({"dynamic": True, "strategy": "token", "symmetric": False}, "cpu_int8", "asymmetric"),
    ],
)
def test_int8_activations_run_as_declared_or_as_w8a16_with_a_note(
    tmp_path: Path, acts: dict[str, object], kernel: str, note: str | None
) -> None:
    path = write_checkpoint(tmp_path / "ct", "ct-int8")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(acts)
    (path / "config.json").write_text(json.dumps(cfg))
    p = plan(str(path), "cpu")
    rows = [r for r in p.rows if r.layer.startswith(DECODER)]
    assert {r.kernel for r in rows} == {kernel}
    w8a16_notes = [n for n in p.notes if "W8A16" in n]
    if note is None:
        assert not w8a16_notes and all("int8 activations" in r.scheme for r in rows)
    else:
        assert len(w8a16_notes) == 1 and note in w8a16_notes[0] and "group_0" in w8a16_notes[0]


@pytest.mark.parametrize(
    ("name", "target", "tp"),
    [
        ("gptq-w4-v1-sym", "cpu", 1),
        ("gptq-w4-v2-asym", "sm80", 2),
        ("fp8-block", "sm75", 1),
        ("bf16", "cpu", 1),
    ],
)
def test_expected_bytes_are_what_the_conversion_writes(
    ckpt: Callable[[str], Path], tmp_path: Path, name: str, target: str, tp: int
) -> None:
    """The plan's size comes from the kernels' declared layouts; the rank files hold exactly that many
    tensor bytes (none of these layers has an optional tensor to leave out)."""
    from services.convert.library import ConversionRequest, convert

    p = plan(str(ckpt(name)), target, tp=tp)
    expected = p.to_json()["expected_bytes"]
    assert expected["total"] == sum(expected["per_rank"]) and len(expected["per_rank"]) == tp
    (result,) = convert(ConversionRequest(str(ckpt(name)), [target], tp=tp, out=str(tmp_path)))
    for rank, want in enumerate(expected["per_rank"]):
        raw = (Path(result.uri) / f"rank{rank}.safetensors").read_bytes()
        header = int.from_bytes(raw[:8], "little")
        assert len(raw) - 8 - header == want, f"rank {rank}"
