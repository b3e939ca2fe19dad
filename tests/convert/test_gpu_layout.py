"""`kiln convert --gpu-layout kiln`: GPU int weight-only layers in Kiln's own layout (tile_wna16);
the default keeps the vLLM-identical bytes and its artifacts as they were."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kernels.errors import KilnError
from kernels.registry import get_kernel
from services.convert.library import ConversionRequest, convert, plan
from services.convert.spec import ConversionOptions, conversion_spec

DECODER = "model.layers."


def _decoder_kernels(p) -> set[str]:  # type: ignore[no-untyped-def]
    return {r.kernel for r in p.rows if r.layer.startswith(DECODER)}


@pytest.mark.parametrize(
    ("name", "kiln"),
    [
        ("gptq-w4-v1-sym", {"tile_wna16"}),
        ("gptq-w4-v2-asym", {"tile_wna16"}),
        ("awq-gemm", {"tile_wna16"}),
        ("ct-w8a16", {"tile_wna16"}),
        ("gptq-w4-actorder", {"tile_wna16"}),  # stored with K sorted by group
        ("fp8-tensor", {"fp8_w8a8"}),  # no Kiln layout of its own yet
    ],
)
def test_kiln_layouts_only_where_asked(ckpt: Callable[[str], Path], name: str, kiln: set[str]) -> None:
    default = plan(str(ckpt(name)), "sm90")
    chosen = plan(str(ckpt(name)), "sm90", gpu_layout="kiln")
    assert "tile_wna16" not in _decoder_kernels(default)
    assert all("tile_wna16" not in dict(u.rejected) for u in default.units)  # nothing said by default
    assert _decoder_kernels(chosen) == kiln
    assert chosen.options.get("gpu_layout") == "kiln" and "gpu_layout" not in default.options
    assert any("--gpu-layout kiln" in n for n in chosen.notes)
    cpu = plan(str(ckpt(name)), "cpu", gpu_layout="kiln")  # GPU targets only
    assert "gpu_layout" not in cpu.options and "tile_wna16" not in _decoder_kernels(cpu)


def test_a_kiln_layout_artifact_verifies_and_holds_the_source_codes(
    ckpt: Callable[[str], Path], tmp_path: Path
) -> None:
    """Converted for sm80 in tile_wna16: verified, a different artifact id from the Marlin one, and
    every layer's stored codes decode to those of the Marlin artifact of the same checkpoint."""
    source = str(ckpt("gptq-w4-v2-asym"))
    (tile,) = convert(ConversionRequest(source, ["sm80"], out=str(tmp_path / "t"), gpu_layout="kiln"))
    (marlin,) = convert(ConversionRequest(source, ["sm80"], out=str(tmp_path / "m")))
    assert tile.manifest.verification.ok and marlin.manifest.verification.ok
    assert tile.manifest.artifact_id != marlin.manifest.artifact_id
    assert json.loads((Path(tile.uri) / "manifest.json").read_text())["options"]["gpu_layout"] == "kiln"
    from safetensors.torch import load_file

    t_tensors = load_file(str(Path(tile.uri) / "rank0.safetensors"))
    m_tensors = load_file(str(Path(marlin.uri) / "rank0.safetensors"))
    compared = 0
    for name, entry in tile.manifest.layers.items():
        if entry.kernel != "tile_wna16":
            continue
        other = marlin.manifest.layers[name]
        spec, mspec = entry.linear_spec(), other.linear_spec()
        declared = get_kernel(entry.kernel).stored_tensors(spec, tile.manifest.target)
        mine = {s: t_tensors[f"{name}.{s}"] for s in declared}
        theirs = {
            s: m_tensors[f"{name}.{s}"]
            for s in get_kernel(other.kernel).stored_tensors(mspec, marlin.manifest.target)
            if f"{name}.{s}" in m_tensors
        }
        a = get_kernel(entry.kernel).stored_int_weight(mine, spec)
        b = get_kernel(other.kernel).stored_int_weight(theirs, mspec)
        assert a is not None and b is not None
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), name
        assert a.zeros is not None and b.zeros is not None and torch.equal(a.zeros, b.zeros), name
        compared += 1
    assert compared >= 4


def test_the_option_is_one_field_left_out_when_unset() -> None:
    assert "gpu_layout" not in ConversionOptions().model_dump(mode="json")
    assert ConversionOptions(gpu_layout="kiln").model_dump(mode="json")["gpu_layout"] == "kiln"
    with pytest.raises(KilnError, match="gpu_layout"):
        conversion_spec(source="/x", targets=["sm80"], options={"gpu_layout": "tiles"})


def test_kiln_plan_takes_the_flag(ckpt: Callable[[str], Path]) -> None:
    from services.cli import app

    result = CliRunner().invoke(
        app, ["plan", str(ckpt("gptq-w4-v1-sym")), "--target", "sm90", "--gpu-layout", "kiln", "--json"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["options"]["gpu_layout"] == "kiln"
    assert {r["kernel"] for r in payload["layers"] if r["layer"].startswith(DECODER)} == {"tile_wna16"}


def test_an_act_order_checkpoint_converts_to_the_group_sorted_tile_layout(
    ckpt: Callable[[str], Path], tmp_path: Path
) -> None:
    """GPTQ act-order, --gpu-layout kiln: every decoder layer on tile_wna16 with its `perm`, the
    artifact verified (the stored weight decodes to the checkpoint's codes and g_idx)."""
    (art,) = convert(
        ConversionRequest(str(ckpt("gptq-w4-actorder")), ["sm80"], out=str(tmp_path / "t"), gpu_layout="kiln")
    )
    assert art.manifest.verification.ok
    from safetensors.torch import load_file

    tensors = load_file(str(Path(art.uri) / "rank0.safetensors"))
    tiled = [name for name, e in art.manifest.layers.items() if e.kernel == "tile_wna16"]
    assert tiled and all(f"{name}.perm" in tensors for name in tiled)
