"""FP4 checkpoints from compressed-tensors (llm-compressor's NVFP4A16 / NVFP4 / MXFP4A16, made here for
real on a tiny random Llama and Qwen3-MoE, and synthetic ones): detection, plans for sm80 and cpu,
decoding against compressed-tensors' own dequantization, exact verification, and bad input refused
naming the layer and tensor. Serving is tests/runtime/test_moe.py (FP4 cells); vLLM's plugin is
tests/vllm_plugin/test_vllm_dtype_matrix.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from devtools.builders.moe import dequantized_state_dict
from devtools.builders.synthetic import write_checkpoint
from kernels.base import Fp4Weight
from kernels.errors import KilnError, UnsupportedError
from kernels.moe_base import MoESpec
from runtime.artifact.manifest import Manifest
from services.convert.errors import ConversionError, TensorLayoutError
from services.convert.library import ConversionRequest, convert, open_and_detect, plan
from services.convert.units.linear import LinearUnit

# Kiln keeps NVFP4's global scale as the multiplier vLLM computes (1 / divisor, rounded once to fp32)
# where compressed-tensors divides: the two dequantizations differ by that rounding at most.
CT_DIVISOR_REL_TOL = 2.0**-22


@pytest.mark.parametrize(
    ("fixture", "describe", "w4a4"),
    [
        ("llama_nvfp4a16", "nvfp4 (E2M1 + E4M3/16 + fp32 global)", False),
        ("llama_nvfp4", "nvfp4 (E2M1 + E4M3/16 + fp32 global, W4A4 source: activations run 16-bit)", True),
        ("llama_mxfp4a16", "mxfp4 (E2M1 + E8M0/32)", False),
    ],
)
def test_plans_name_the_fp4_encoding_and_kernel(
    fixture: str, describe: str, w4a4: bool, request: pytest.FixtureRequest
) -> None:
    source: Path = request.getfixturevalue(fixture)
    for target, kernel in (("sm80", "marlin_fp4"), ("sm90", "marlin_fp4"), ("cpu", "cpu_fp4")):
        p = plan(str(source), target)
        rows = {r.layer: r for r in p.rows}
        for layer in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"):
            assert rows[layer].scheme == describe and rows[layer].kernel == kernel, rows[layer]
        assert rows["lm_head"].kernel == "dense"
        notes = " ".join(p.notes)
        assert ("activations run 16-bit" in notes) == w4a4, p.notes
        if w4a4:  # the static input global scales are dropped, and said so
            assert "input_global_scale" in notes and "are not used" in notes


@pytest.mark.parametrize("fixture", ["qwen3_moe_nvfp4a16", "qwen3_moe_mxfp4a16"])
def test_moe_plans_put_experts_on_fp4_expert_kernels(fixture: str, request: pytest.FixtureRequest) -> None:
    source: Path = request.getfixturevalue(fixture)
    for target, kernel in (("sm80", "marlin_fp4_experts"), ("cpu", "cpu_fp4_experts")):
        rows = {r.layer: r for r in plan(str(source), target).rows}
        assert rows["model.layers.0.mlp.experts"].kernel == kernel
        assert rows["model.layers.0.mlp.gate"].kernel == "dense"  # the router stays dense


@pytest.mark.parametrize("fixture", ["llama_nvfp4a16", "llama_mxfp4a16", "qwen3_moe_nvfp4a16"])
def test_decoded_weights_equal_compressed_tensors_dequantization(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    source: Path = request.getfixturevalue(fixture)
    reference = dequantized_state_dict(source)
    p = plan(str(source), "cpu")
    ckpt, fmt = open_and_detect(str(source))
    checked = 0
    for unit in p.units:
        if not isinstance(unit, LinearUnit) or unit.quant.scheme != "fp4":
            continue
        tensors = ckpt.read(unit.source_tensors)
        for shard in unit.layout.shards:
            w = fmt.decode(shard.module, unit.quant, tensors)
            assert isinstance(w, Fp4Weight)
            want = reference[f"{shard.module}.weight"]
            got = w.dequantize()
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel <= CT_DIVISOR_REL_TOL, (shard.module, rel)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("name", ["ct-nvfp4", "ct-mxfp4"])
def test_fp4_conversions_verify_exact(name: str, ckpt: Callable[[str], Path], tmp_path: Path) -> None:
    source = ckpt(name)
    for r in convert(ConversionRequest(str(source), ["sm80", "cpu"], out=str(tmp_path))):
        quantized = [e for e in r.manifest.layers.values() if e.kernel in ("marlin_fp4", "cpu_fp4")]
        assert quantized and all(e.verification and e.verification.metric == "exact" for e in quantized)


def _copy(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def _edit_tensors(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(f), metadata={"format": "pt"})


def _edit_weights_config(path: Path, **weights: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (path / "config.json").write_text(json.dumps(cfg))


def _convert_error(source: Path, out: Path) -> KilnError:
    with pytest.raises(KilnError) as info:
        convert(ConversionRequest(str(source), ["cpu"], out=str(out)))
    assert not any(out.glob("*/manifest.json")), "a failed conversion left an artifact"
    return info.value


def test_bad_fp4_checkpoints_are_refused_naming_layer_and_tensor(tmp_path: Path) -> None:
    good = write_checkpoint(tmp_path / "good", "ct-nvfp4")
    layer = "model.layers.0.self_attn.k_proj"

    missing = _copy(good, tmp_path / "missing-global")
    _edit_tensors(missing, {f"{layer}.weight_global_scale": None})
    e = _convert_error(missing, tmp_path / "out1")
    assert isinstance(e, ConversionError) and f"{layer}.weight_global_scale" in str(e)

    nan_scale = _copy(good, tmp_path / "nan-scale")
    scales = load_file(str(good / "model.safetensors"))[f"{layer}.weight_scale"].clone()
    scales.view(torch.uint8)[0, 0] = 0x7F  # E4M3 NaN
    _edit_tensors(nan_scale, {f"{layer}.weight_scale": scales})
    e = _convert_error(nan_scale, tmp_path / "out2")
    assert isinstance(e, TensorLayoutError) and layer in str(e) and "E4M3" in str(e)

    wrong_dtype = _copy(good, tmp_path / "wrong-dtype")
    _edit_tensors(wrong_dtype, {f"{layer}.weight_scale": scales.float()})
    e = _convert_error(wrong_dtype, tmp_path / "out3")
    assert isinstance(e, TensorLayoutError) and layer in str(e) and "float8_e4m3fn" in str(e)

    mx = write_checkpoint(tmp_path / "mx", "ct-mxfp4")
    mx_scales = load_file(str(mx / "model.safetensors"))[f"{layer}.weight_scale"].clone()
    mx_scales[1, 2] = 255
    _edit_tensors(mx, {f"{layer}.weight_scale": mx_scales})
    e = _convert_error(mx, tmp_path / "out4")
    assert isinstance(e, TensorLayoutError) and layer in str(e) and "255 (NaN)" in str(e)


@pytest.mark.parametrize(
    ("edit", "what"),
    [({"group_size": 32}, "tensor_group"), ({"symmetric": False}, "tensor_group")],
)
def test_fp4_variants_vllm_does_not_run_are_refused(
    tmp_path: Path, edit: dict[str, object], what: str
) -> None:
    source = write_checkpoint(tmp_path / "src", "ct-nvfp4")
    _edit_weights_config(source, **edit)
    with pytest.raises(UnsupportedError, match=what):
        plan(str(source), "cpu")


def test_sm80_expert_groups_carry_the_groups_scale_factor(qwen3_moe_nvfp4a16: Path, tmp_path: Path) -> None:
    """marlin_fp4_experts: one NVFP4 scale factor per part over all experts (vLLM's MoE prepare),
    recorded in the manifest's specs, which the loader's schema accepts; every expert verified."""
    (result,) = convert(ConversionRequest(str(qwen3_moe_nvfp4a16), ["sm80"], out=str(tmp_path)))
    manifest = Manifest.load(tmp_path / result.manifest.artifact_id)
    assert manifest.expert_groups
    for entry in manifest.expert_groups.values():
        spec = MoESpec.from_json(entry.spec)  # type: ignore[arg-type]
        assert entry.kernel == "marlin_fp4_experts" and entry.verification and entry.verification.ok
        # llm-compressor's block scales reach 448 * amax_block / amax_tensor: the factor is 1 or 2
        assert spec.w13.group_scale_factor in (1.0, 2.0) and spec.w2.group_scale_factor in (1.0, 2.0)


@pytest.mark.parametrize("fixture", ["qwen3_moe_nvfp4a16", "qwen3_moe_mxfp4a16"])
def test_kiln_gpu_layout_runs_fp4_experts_on_the_tile_loop(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """No fused FP4 expert kernel either way: --gpu-layout kiln swaps the per-expert loop over
    marlin_fp4 for the one over tile_fp4; the router stays dense."""
    source = str(request.getfixturevalue(fixture))
    default = {r.layer: r.kernel for r in plan(source, "sm90").rows}
    kiln = {r.layer: r.kernel for r in plan(source, "sm90", gpu_layout="kiln").rows}
    assert default["model.layers.0.mlp.experts"] == "marlin_fp4_experts"
    assert kiln["model.layers.0.mlp.experts"] == "tile_fp4_experts"
    assert kiln["model.layers.0.mlp.gate"] == "dense"


@pytest.mark.parametrize("fixture", ["llama_nvfp4a16", "llama_mxfp4a16"])
def test_kiln_gpu_layout_stores_fp4_layers_for_tile_fp4(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """--gpu-layout kiln: the decoder's FP4 layers on tile_fp4, verified, their codes those of the
    Marlin FP4 artifact of the same checkpoint (the default, unchanged)."""
    from kernels.registry import get_kernel

    source = str(request.getfixturevalue(fixture))
    rows = {r.layer: r for r in plan(source, "sm90", gpu_layout="kiln").rows}
    assert rows["model.layers.0.self_attn.qkv_proj"].kernel == "tile_fp4"
    assert rows["model.layers.1.mlp.down_proj"].kernel == "tile_fp4"
    (tile,) = convert(ConversionRequest(source, ["sm80"], out=str(tmp_path / "t"), gpu_layout="kiln"))
    (marlin,) = convert(ConversionRequest(source, ["sm80"], out=str(tmp_path / "m")))
    assert tile.manifest.verification.ok and marlin.manifest.artifact_id != tile.manifest.artifact_id
    t_tensors = load_file(str(Path(tile.uri) / "rank0.safetensors"))
    m_tensors = load_file(str(Path(marlin.uri) / "rank0.safetensors"))
    compared = 0
    for name, entry in tile.manifest.layers.items():
        if entry.kernel != "tile_fp4":
            continue
        other = marlin.manifest.layers[name]
        assert other.kernel == "marlin_fp4", name
        mine = get_kernel("tile_fp4").stored_weight(_layer_tensors(t_tensors, name), entry.linear_spec())
        theirs = get_kernel("marlin_fp4").stored_weight(_layer_tensors(m_tensors, name), other.linear_spec())
        assert torch.equal(mine.codes, theirs.codes), name
        compared += 1
    assert compared >= 7  # 2 layers x (qkv, o, gate_up, down)


def _layer_tensors(tensors: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    """One layer's stored tensors of a rank file, by their short names."""
    prefix = f"{layer}."
    return {
        name[len(prefix) :]: t
        for name, t in tensors.items()
        if name.startswith(prefix) and "." not in name[len(prefix) :]
    }
