"""Verification: every converted layer is dequantized from the artifact's own tensors (through its
kernel's `dequantize`) and compared with the source's canonical weights.

Bounds (named, documented):
* integer layers: identical to the canonical dequantization (scales as stored, or cast to the
  activation dtype) -> "exact". A kernel that rounds scales to a narrower float (cpu_int4 / cpu_int8
  keep bf16 scales) may differ per element by |q - z| * SCALE_ROUNDING_REL steps plus at most
  INT_STEP_BOUND steps ("max_step_err" = the worst excess in units of the element's group scale);
  one wrong code or zero point is a whole step and fails. A float minimum (w = q * s + m, GGUF
  Q4_1 / Q4_K) is exact only as stored in the checkpoint; rounded (gptq_wna16 stores it in the
  activation dtype) it moves w by up to |m| * 2^-9, allowed as |m| / s * MIN_ROUNDING_REL steps
  (`rounding_allowance`: a rounded scale then multiplies q or q - mid, as the layout has it).
* FP8 from an FP8 checkpoint: exact unless the kernel requantizes fused per-tensor shards to one
  scale (vLLM's requantize_with_max_scale) or casts scales: max |diff| / max |w| <= FP8_REL_BOUND.
* online FP8 (from bf16/fp16): e4m3 round-to-nearest has relative error <= 2^-4 for normals and a
  negligible absolute error for subnormals, so max |diff| / max |w| <= FP8_REL_BOUND.
* dense layers: exact unless the kernel casts the dtype (bf16 -> fp16 for sm75, fp32 -> bf16):
  max |diff| / max |w| <= DENSE_CAST_REL_BOUND.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from kernels.base import DenseWeight, Fp8Weight, IntWeight, SourceWeight
from runtime.artifact.manifest import LayerVerification

INT_STEP_BOUND = 0.25
SCALE_ROUNDING_REL = 2.0**-8  # a scale rounded to bf16 (2^-9 relative) with 2x slack
MIN_ROUNDING_REL = 2.0**-8  # a float minimum rounded to bf16 (2^-9 relative) with 2x slack
FP8_REL_BOUND = 0.07  # 2^-4 (half an e4m3 ulp, relative) plus scale rounding slack
DENSE_CAST_REL_BOUND = 2.0**-8
_TINY = 1e-30
CHUNK_ELEMENTS = 1 << 24  # elements compared per step: temporaries stay bounded (64 MB of fp32)


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    return float(diff.max() / ref.abs().max().clamp_min(_TINY)) if diff.numel() else 0.0


def references(source: SourceWeight, act_dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """(N, K) float32 weights the artifact may reproduce exactly, computed lazily: integer scales as
    stored in the checkpoint, then cast to the activation dtype (what vLLM's loader does)."""
    yield source.dequantize()
    if isinstance(source, IntWeight) and source.scales.dtype != act_dtype:
        yield dataclasses.replace(source, scales=source.scales.to(act_dtype), bias=None).dequantize()


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| (NaN-propagating) without an |t| temporary: aminmax is far faster than abs().max()
    or vector_norm(inf) on CPU."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).float()


def compare_float(
    got: torch.Tensor, ref: torch.Tensor, bound: float, *, try_exact: bool
) -> LayerVerification:
    """`got` (any float dtype) against the float reference `ref`, in row chunks cast to fp32: "exact"
    when every element is equal, else max |got - ref| / max |ref| against `bound` (NaN never passes)."""
    if got.shape != ref.shape:
        return LayerVerification(ok=False, metric="exact", value=float("inf"), bound=0.0)
    if got.numel() == 0:
        return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)
    g2 = got.reshape(got.shape[0], -1) if got.dim() > 1 else got.reshape(-1, 1)
    r2 = ref.reshape(g2.shape)
    rows = max(1, CHUNK_ELEMENTS // max(1, g2.shape[1]))
    exact = try_exact
    diff_max = torch.zeros((), dtype=torch.float32)
    for i in range(0, g2.shape[0], rows):
        g = g2[i : i + rows]
        r = r2[i : i + rows]
        if g.dtype != torch.float32 and r.dtype != torch.float32:
            g = g.float()
        if exact and torch.equal(g, r if r.dtype == g.dtype else r.to(g.dtype)):
            continue
        exact = False
        diff = r.to(torch.float32, copy=True)  # never the reference itself: it is modified in place
        diff.sub_(g)
        diff_max = torch.maximum(diff_max, _abs_max(diff))
    if exact:
        return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)
    ref_max = _abs_max(ref)
    value = float(diff_max / ref_max.clamp_min(_TINY))
    if value != value:  # NaN (a non-finite weight) never passes
        value = float("inf")
    return LayerVerification(ok=value <= bound, metric="max_rel_err", value=value, bound=bound)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def compare_dense_stored(stored: torch.Tensor, source: DenseWeight) -> LayerVerification:
    """A dense layer whose kernel stores the weight itself (dequantize = `.float()`): the stored
    tensor against the source weight directly — equal when the dtype is kept, else within the cast
    bound — without fp32 copies of either side. When the kernel stored the source tensor itself
    (same memory), the bytes written are the source's by construction: nothing to compare (a
    non-finite source value is then carried as is, like a plain copy)."""
    w = source.weight
    if _same_view(stored, w):  # the kernel stores the source tensor itself: its bytes are written as is
        return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)
    if stored.dtype == w.dtype and stored.shape == w.shape and torch.equal(stored, w):  # NaN never equal
        return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)
    return compare_float(stored, source.weight, DENSE_CAST_REL_BOUND, try_exact=True)


def compare_int_stored(
    stored: IntWeight | None, source: SourceWeight, act_dtype: torch.dtype
) -> LayerVerification | None:
    """ "exact" when the integer weight a layout stores (`LinearKernel.stored_int_weight`) equals the
    source value for value: codes, zero points or float minimums (their values as in the checkpoint),
    group of every input channel, scales as in the checkpoint or cast to the activation dtype. None
    otherwise: the caller then compares the dequantized weights, which also measures how far off
    they are."""
    if stored is None or not isinstance(source, IntWeight):
        return None
    if stored.bits != source.bits or stored.codes.shape != source.codes.shape:
        return None
    if not torch.equal(stored.codes, source.codes.to(stored.codes.dtype)):
        return None
    if (stored.zeros is None) != (source.zeros is None):
        return None
    if stored.zeros is not None and not torch.equal(stored.zeros, source.zeros.to(stored.zeros.dtype)):  # type: ignore[union-attr]
        return None
    if (stored.mins is None) != (source.mins is None):
        return None
    # minimums as in the checkpoint only (no act-dtype cast is "exact" for them: `references`)
    if stored.mins is not None and not torch.equal(stored.mins.float(), source.mins.float()):  # type: ignore[union-attr]
        return None
    if not torch.equal(stored.group_index(), source.group_index()):
        return None
    scales = (source.scales, source.scales.to(act_dtype))
    if not any(s.dtype == stored.scales.dtype and torch.equal(s, stored.scales) for s in scales):
        return None
    return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)


def rounding_allowance(source: IntWeight, gi: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(N, K) steps each element may move when the layout rounds the scales (and float minimums) to a
    narrower float; `gi`: group of every input channel, `step`: |s| of every element (N, K).
    w = (q - z) * s: |q - z| * SCALE_ROUNDING_REL. w = q * s + m: the rounded scale multiplies q where
    the layout stores m (gptq_wna16) and q - mid where it keeps mid * s + m exact (cpu_int4), so
    max(q, |q - mid|) * SCALE_ROUNDING_REL, plus |m| / s * MIN_ROUNDING_REL for a rounded m."""
    codes = source.codes.float()
    mid = torch.full_like(step, float(1 << (source.bits - 1)))
    if source.mins is not None:
        scale_part = torch.maximum(codes, (codes - mid).abs()) * SCALE_ROUNDING_REL
        return scale_part + source.mins.float()[gi].T.abs() / step * MIN_ROUNDING_REL
    zeros = mid if source.zeros is None else source.zeros.float()[gi].T
    return (codes - zeros).abs() * SCALE_ROUNDING_REL


def compare(
    got: torch.Tensor, source: SourceWeight, act_dtype: torch.dtype, *, online_fp8: bool = False
) -> LayerVerification:
    if isinstance(source, DenseWeight):
        bound = FP8_REL_BOUND if online_fp8 else DENSE_CAST_REL_BOUND
        return compare_float(got, source.weight, bound, try_exact=not online_fp8)
    refs: list[torch.Tensor] = []
    got = got.float()
    for r in references(source, act_dtype):
        if got.shape != r.shape:
            return LayerVerification(ok=False, metric="exact", value=float("inf"), bound=0.0)
        if torch.equal(got, r):
            return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)
        refs.append(r)
    ref = refs[0]
    if isinstance(source, IntWeight) and not online_fp8:
        gi = source.group_index()
        step = source.scales.float()[gi].T.abs().clamp_min(_TINY)
        rounding = rounding_allowance(source, gi, step)
        value = min(float(((got - r).abs() / step - rounding).max()) for r in refs)
        if value < 0:  # every element within its allowance (a float minimum's is > 0 everywhere)
            value = 0.0
        return LayerVerification(
            ok=value <= INT_STEP_BOUND, metric="max_step_err", value=value, bound=INT_STEP_BOUND
        )
    bound = FP8_REL_BOUND if (online_fp8 or isinstance(source, Fp8Weight)) else DENSE_CAST_REL_BOUND
    value = _rel((got - ref).abs(), ref)
    if value != value:  # NaN (a non-finite weight) never passes
        value = float("inf")
    return LayerVerification(ok=value <= bound, metric="max_rel_err", value=value, bound=bound)


def worst_of(a: LayerVerification | None, b: LayerVerification) -> LayerVerification:
    """The worse of two checks (any inexact one is worse than an exact one): a layer's record."""
    if a is None or (b.metric != "exact" and (a.metric == "exact" or b.value > a.value)):
        return b
    return a
