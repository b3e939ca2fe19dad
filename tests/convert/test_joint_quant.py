"""Fused layers / expert groups whose parts are quantized differently (services/convert/formats/joint.py):
the joint quantization, and the re-encoding checked value for value."""

from __future__ import annotations

import pytest
import torch

from kernels.base import IntWeight
from kernels.errors import UnsupportedError
from services.convert.formats.base import DENSE, LayerQuant
from services.convert.formats.joint import joint_quant, re_encode

Q4_K = LayerQuant("int", bits=4, group_size=32, symmetric=False, float_zeros=True)
Q6_K = LayerQuant("int", bits=6, group_size=16)
Q4_0 = LayerQuant("int", bits=4, group_size=32)
Q8_0 = LayerQuant("int", bits=8, group_size=32)
GPTQ_ASYM = LayerQuant("int", bits=4, group_size=128, symmetric=False)
GPTQ_ACT_ORDER = LayerQuant("int", bits=4, group_size=128, act_order=True)


def test_the_joint_quantization_is_the_widest_codes_and_the_common_group() -> None:
    assert joint_quant([Q4_K, Q4_K]) == Q4_K
    assert joint_quant([Q4_K, Q4_K, Q6_K]) == LayerQuant(
        "int", bits=6, group_size=16, symmetric=False, float_zeros=True
    )
    assert joint_quant([Q4_0, Q8_0]) == Q8_0  # symmetric parts stay symmetric
    assert joint_quant([Q4_0, Q6_K]) == LayerQuant("int", bits=6, group_size=16)


@pytest.mark.parametrize(
    "other", [DENSE, GPTQ_ASYM, GPTQ_ACT_ORDER, LayerQuant("int", bits=4, group_size=-1)]
)
def test_parts_without_an_exact_joint_quantization_have_none(other: LayerQuant) -> None:
    assert joint_quant([Q4_0, other]) is None


def _symmetric(bits: int, group: int, scales: torch.Tensor, seed: int = 0) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    n, k = scales.shape[1], scales.shape[0] * group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    return IntWeight(codes, scales, bits, group)


def test_re_encoding_keeps_every_value() -> None:
    gen = torch.Generator().manual_seed(1)
    q4_0 = _symmetric(4, 32, torch.rand(2, 8, generator=gen).half())  # fp16 d, as GGUF Q4_0
    q6_k = _symmetric(6, 16, (torch.randint(1, 128, (4, 8), generator=gen) * 2.0**-12).float())
    for lq in (joint_quant([Q4_0, Q6_K]), joint_quant([Q4_K, Q6_K])):
        assert lq is not None
        for w in (q4_0, q6_k):
            out = re_encode(w, lq, "layer")
            assert (out.bits, out.group_size, out.mins is not None) == (lq.bits, 16, lq.float_zeros)
            assert out.scales.dtype == torch.float32 and out.scales.shape == (4, 8)
            assert torch.equal(out.dequantize(), w.dequantize())


def test_a_part_whose_values_would_change_is_refused_naming_it() -> None:
    """q * s + m rounds where (q - z) * s did not: a 24-significant-bit fp32 scale."""
    w = _symmetric(6, 16, torch.full((4, 8), 1.0 + 2.0**-23))
    lq = joint_quant([Q4_K, Q6_K])
    assert lq is not None
    with pytest.raises(
        UnsupportedError, match=r"layer blk\.0\.attn_v: its int6 g16 weight does not re-encode"
    ):
        re_encode(w, lq, "blk.0.attn_v")
