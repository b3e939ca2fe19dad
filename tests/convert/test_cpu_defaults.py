"""The cpu target's defaults (services/convert/cpu_defaults.py): a checkpoint with 4-bit layers gets
int8 activations into them (cpu_w4a8) and an int8 head (cpu_int8); `--quantize-head none` and
`--no-int8-activations` keep 16-bit ones; other checkpoints and GPU targets convert as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kernels.errors import UnsupportedError
from services.convert.library import plan
from services.convert.spec import ConversionOptions

DECODER = "model.layers."
HEAD = "lm_head"


def _kernels(p) -> tuple[set[str], str]:  # type: ignore[no-untyped-def]
    """(the decoder layers' kernels, lm_head's)."""
    (head,) = [u.kernel.name for u in p.units if u.name == HEAD]
    return {u.kernel.name for u in p.units if u.name.startswith(DECODER)}, head


@pytest.mark.parametrize("name", ["gptq-w4-v1-sym", "gptq-w4-v2-asym", "awq-gemm", "ct-w4a16-asym"])
def test_a_4bit_checkpoint_on_cpu_takes_int8_activations_and_an_int8_head(
    ckpt: Callable[[str], Path], name: str
) -> None:
    p = plan(str(ckpt(name)), "cpu")
    assert _kernels(p) == ({"cpu_w4a8"}, "cpu_int8")
    assert p.options == {"quantize_head": "int8", "int8_activations": "4-bit"}
    notes = " ".join(p.notes)
    assert "cpu default for a 4-bit checkpoint" in notes
    assert "--quantize-head none" in notes and "--no-int8-activations" in notes


def test_each_default_is_declined_on_its_own(ckpt: Callable[[str], Path]) -> None:
    source = str(ckpt("gptq-w4-v1-sym"))
    weight_only = plan(source, "cpu", quantize_head="none", int8_activations=False)
    assert _kernels(weight_only) == ({"cpu_int4"}, "dense") and weight_only.options == {}
    a16 = plan(source, "cpu", int8_activations=False)
    assert _kernels(a16) == ({"cpu_int4"}, "cpu_int8") and a16.options == {"quantize_head": "int8"}
    head16 = plan(source, "cpu", quantize_head="none")
    assert _kernels(head16) == ({"cpu_w4a8"}, "dense")
    assert head16.options == {"int8_activations": "4-bit"}


def test_act_order_layers_keep_cpu_int4_under_the_defaults(ckpt: Callable[[str], Path]) -> None:
    p = plan(str(ckpt("gptq-w4-actorder")), "cpu")
    assert _kernels(p) == ({"cpu_int4"}, "cpu_int8")


@pytest.mark.parametrize("name", ["bf16", "fp8-tensor", "ct-fp8-channel", "ct-int8"])
def test_checkpoints_without_4bit_layers_convert_as_before(ckpt: Callable[[str], Path], name: str) -> None:
    p = plan(str(ckpt(name)), "cpu")
    assert _kernels(p)[1] == "dense"
    assert "quantize_head" not in p.options and "int8_activations" not in p.options


def test_the_requested_option_still_moves_8bit_layers(ckpt: Callable[[str], Path]) -> None:
    p = plan(str(ckpt("gptq-w4-v1-sym")), "cpu", int8_activations=True)
    assert p.options == {"quantize_head": "int8", "int8_activations": True}
    assert "--int8-activations:" in " ".join(p.notes)


@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_gpu_targets_take_neither_default(ckpt: Callable[[str], Path], target: str) -> None:
    source = str(ckpt("gptq-w4-v1-sym"))
    p = plan(source, target)
    assert _kernels(p)[1] == "dense" and p.options == {}
    assert plan(source, target, quantize_head="none", int8_activations=False).options == {}
    with pytest.raises(UnsupportedError, match="--int8-activations is for the cpu target"):
        plan(source, target, int8_activations=True)


def test_a_request_that_leaves_them_open_keeps_its_digest() -> None:
    """Job rows written before the defaults (no such keys) read back as 'the target's default'."""
    assert ConversionOptions().model_dump() == {
        "fp8_scheme": "tensor",
        "disabled_kernels": [],
        "expert_parallel": False,
    }
    declined = ConversionOptions(quantize_head="none", int8_activations=False).model_dump()
    assert declined["quantize_head"] == "none" and declined["int8_activations"] is False
