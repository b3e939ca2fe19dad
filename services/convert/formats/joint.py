"""Parts of one fused layer or expert group that a checkpoint quantizes differently: llama.cpp's
Q4_K_M stores q/k as Q4_K beside a Q6_K v, and expert down projections as Q6_K beside Q4_K gate/up.

`joint_quant` finds one integer quantization every part re-encodes into exactly — the widest codes,
the greatest common group, a float minimum if any part has one — and `re_encode` moves a decoded
part into it: each group's scale (and minimum) repeated over its sub-groups, a symmetric part's
implicit zero turned into a minimum `-2**(bits-1) * scale` (power-of-two multiple: exact) or, when
every part is symmetric, its codes moved to the wider midpoint. Scales and minimums become float32
(every source dtype widens into it exactly). `re_encode` checks, a row block at a time, that the
re-encoded part dequantizes to exactly the values the part did, and refuses the layer otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kernels.base import IntWeight, SourceWeight
from kernels.errors import UnsupportedError
from services.convert.formats.base import LayerQuant


def joint_quant(quants: Sequence[LayerQuant]) -> LayerQuant | None:
    """The quantization every one of `quants` re-encodes into exactly, or None: they are all the same,
    or all grouped integer ones (no act-order, no integer zero points) declaring the same activations."""
    first = quants[0]
    if all(q == first for q in quants):
        return first
    re_encodable = all(
        q.scheme == "int"
        and not q.act_order
        and not q.codebook
        and q.group_size > 0
        and (q.symmetric or q.float_zeros)
        for q in quants
    )
    if not re_encodable or len({q.int8_activations for q in quants}) > 1:
        return None
    float_min = any(q.float_zeros for q in quants)
    return LayerQuant(
        "int",
        bits=max(q.bits for q in quants),
        group_size=math.gcd(*(q.group_size for q in quants)),
        symmetric=not float_min,
        float_zeros=float_min,
        int8_activations=first.int8_activations,
    )


def re_encode(w: SourceWeight, lq: LayerQuant, module: str) -> IntWeight:
    """`w` (one decoded part) in the joint quantization `lq`, value for value."""
    if not isinstance(w, IntWeight) or w.zeros is not None or w.g_idx is not None or w.codebook is not None:
        raise UnsupportedError(f"layer {module}: only grouped integer weights without zero points re-encode")
    reps = w.group_size // lq.group_size
    scales = w.scales.float().repeat_interleave(reps, 0)  # (G', N)
    codes, mins = w.codes, None
    if lq.float_zeros:
        own = w.mins.float() if w.mins is not None else -float(1 << (w.bits - 1)) * w.scales.float()
        mins = own.repeat_interleave(reps, 0)  # (G', N)
    else:
        codes = w.codes + ((1 << (lq.bits - 1)) - (1 << (w.bits - 1)))  # (N, K) at the wider midpoint
    out = dataclasses.replace(
        w, codes=codes, scales=scales, bits=lq.bits, group_size=lq.group_size, mins=mins
    )
    for (rows, was), (_, now) in zip(w.dequantized_rows(), out.dequantized_rows(), strict=True):
        if not torch.equal(was, now):
            differ = int((was != now).sum())
            raise UnsupportedError(
                f"layer {module}: its int{w.bits} g{w.group_size} weight does not re-encode exactly as "
                f"{lq.describe()} (the joint quantization of its fused layer / expert group): {differ} "
                f"values of rows {rows.start}..{rows.stop - 1} change; quantize the parts alike"
            )
    return out
