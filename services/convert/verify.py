"""Verification: every converted layer is dequantized from the artifact's own tensors (through its
kernel's `dequantized_rows`) and compared with the source's canonical weights, one block of output
rows at a time (`kernels.base.row_block_slices`): the temporaries are a block's, not the layer's.

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
* online int8 lm_head (--quantize-head int8): max |diff| / max |w| <= INT8_ONLINE_REL_BOUND.
* online FP8 (from bf16/fp16): e4m3 round-to-nearest has relative error <= 2^-4 for normals and a
  negligible absolute error for subnormals, so max |diff| / max |w| <= FP8_REL_BOUND.
* FP4 (NVFP4 / MXFP4): exact, except where marlin_fp4 stores a block scale as 0 as vLLM's Marlin FP4
  processing does (s * sf * 2^7 < 2, sf lifting the layer's largest scale above 224 in bf16): those
  blocks' weights are below 6 * 2^-6 / sf * g, under 2^-13.8 of the largest weight whenever the
  largest block scale times sf exceeds 224 (always in bf16; in fp16 for amax-normalized checkpoints,
  whose largest block scale is 448): max |diff| / max |w| <= FP4_MARLIN_FLUSH_REL_BOUND.
* dense layers: exact unless the kernel casts the dtype (bf16 -> fp16 for sm75, fp32 -> bf16):
  max |diff| / max |w| <= DENSE_CAST_REL_BOUND.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from kernels.base import (
    DenseWeight,
    Fp4Weight,
    Fp8Weight,
    IntWeight,
    RowBlocks,
    SourceWeight,
    row_block_slices,
)
from kernels.codecs.fp8 import QuantError
from runtime.artifact.manifest import LayerVerification

INT_STEP_BOUND = 0.25
SCALE_ROUNDING_REL = 2.0**-8  # a scale rounded to bf16 (2^-9 relative) with 2x slack
MIN_ROUNDING_REL = 2.0**-8  # a float minimum rounded to bf16 (2^-9 relative) with 2x slack
FP8_REL_BOUND = 0.07  # 2^-4 (half an e4m3 ulp, relative) plus scale rounding slack
# channelwise int8 (--quantize-head): half a step, max |row| / 254, plus the codes clamped at 127
# under a scale rounded down to bf16 (2^-9 relative), with 2x slack
INT8_ONLINE_REL_BOUND = 2.0**-7
ONLINE_REL_BOUNDS = {"fp8": FP8_REL_BOUND, "int": INT8_ONLINE_REL_BOUND}  # by the scheme quantized to
DENSE_CAST_REL_BOUND = 2.0**-8
FP4_MARLIN_FLUSH_REL_BOUND = 2.0**-12  # 2^-13.8 (flushed block scales, see above) with slack
_TINY = 1e-30


def _exact() -> LayerVerification:
    return LayerVerification(ok=True, metric="exact", value=0.0, bound=0.0)


def _mismatch() -> LayerVerification:
    """The stored weight's shape is not the source's."""
    return LayerVerification(ok=False, metric="exact", value=float("inf"), bound=0.0)


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| (NaN-propagating) without an |t| temporary: aminmax is far faster than abs().max()
    or vector_norm(inf) on CPU."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).float()


def compare_float(
    got: torch.Tensor, ref: torch.Tensor, bound: float, *, try_exact: bool
) -> LayerVerification:
    """`got` (any float dtype) against the float reference `ref`, in row blocks cast to fp32: "exact"
    when every element is equal, else max |got - ref| / max |ref| against `bound` (NaN never passes)."""
    if got.shape != ref.shape:
        return _mismatch()
    if got.numel() == 0:
        return _exact()
    g2 = got.reshape(got.shape[0], -1) if got.dim() > 1 else got.reshape(-1, 1)
    r2 = ref.reshape(g2.shape)
    return _compare_float_rows(_blocks_of(g2), lambda rows: r2[rows], g2.shape[0], bound, try_exact=try_exact)


def _blocks_of(w: torch.Tensor) -> RowBlocks:
    """A whole (N, K) tensor as row blocks."""
    n, k = w.shape[0], (w[0].numel() if w.shape[0] else 0)
    for rows in row_block_slices(n, k):
        yield rows, w[rows]


def _compare_float_rows(
    blocks: Iterable[tuple[slice, torch.Tensor]],
    ref_rows: Callable[[slice], torch.Tensor],
    n: int,
    bound: float,
    *,
    try_exact: bool,
) -> LayerVerification:
    """`compare_float` on row blocks of `got` against the same rows of the reference."""
    exact = try_exact
    diff_max = torch.zeros((), dtype=torch.float32)
    ref_max = torch.zeros((), dtype=torch.float32)
    covered = 0
    for rows, g in blocks:
        r = ref_rows(rows)
        if g.shape != r.shape:
            return _mismatch()
        covered += g.shape[0]
        ref_max = torch.maximum(ref_max, _abs_max(r))
        if g.dtype != torch.float32 and r.dtype != torch.float32:
            g = g.float()
        if exact and torch.equal(g, r if r.dtype == g.dtype else r.to(g.dtype)):
            continue
        exact = False
        diff = r.to(torch.float32, copy=True)  # never the reference itself: it is modified in place
        diff.sub_(g)
        diff_max = torch.maximum(diff_max, _abs_max(diff))
    if covered != n:
        return _mismatch()
    if exact:
        return _exact()
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
        return _exact()
    if stored.dtype == w.dtype and stored.shape == w.shape and torch.equal(stored, w):  # NaN never equal
        return _exact()
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
    # minimums as in the checkpoint only (no act-dtype cast is "exact" for them: `_compare_int_rows`)
    if stored.mins is not None and not torch.equal(stored.mins.float(), source.mins.float()):  # type: ignore[union-attr]
        return None
    if not torch.equal(stored.group_index(), source.group_index()):
        return None
    if (stored.codebook is None) != (source.codebook is None) or (
        stored.codebook is not None and not torch.equal(stored.codebook, source.codebook.float())  # type: ignore[union-attr]
    ):
        return None
    scales = (source.scales, source.scales.to(act_dtype))
    if not any(s.dtype == stored.scales.dtype and torch.equal(s, stored.scales) for s in scales):
        return None
    return _exact()


def rounding_allowance(source: IntWeight, gi: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(N, K) steps each element may move when the layout rounds the scales (and float minimums) to a
    narrower float; `gi`: group of every input channel, `step`: |s| of every element (N, K).
    w = (q - z) * s: |q - z| * SCALE_ROUNDING_REL. w = q * s + m: the rounded scale multiplies q where
    the layout stores m (gptq_wna16) and q - mid where it keeps mid * s + m exact (cpu_int4), so
    max(q, |q - mid|) * SCALE_ROUNDING_REL, plus |m| / s * MIN_ROUNDING_REL for a rounded m."""
    codes = source.codes.float()
    if source.codebook is not None:  # w = table[q] * s: |table[q]| steps of the rounded scale
        return source.codebook.float()[source.codes.long()].abs() * SCALE_ROUNDING_REL
    mid = torch.full_like(step, float(1 << (source.bits - 1)))
    if source.mins is not None:
        scale_part = torch.maximum(codes, (codes - mid).abs()) * SCALE_ROUNDING_REL
        return scale_part + source.mins.float()[gi].T.abs() / step * MIN_ROUNDING_REL
    zeros = mid if source.zeros is None else source.zeros.float()[gi].T
    return (codes - zeros).abs() * SCALE_ROUNDING_REL


def compare(
    got: torch.Tensor | Iterable[tuple[slice, torch.Tensor]],
    source: SourceWeight,
    act_dtype: torch.dtype,
    *,
    online: str | None = None,
) -> LayerVerification:
    """The stored layer dequantized — an (N, K) tensor or its row blocks
    (`LinearKernel.dequantized_rows`) — against the source, one row block at a time (the
    temporaries stay a block's size, whatever the layer's). `online`: the scheme the converter
    quantized a dense source to ("fp8" for --method fp8, "int" for --quantize-head), whose rounding
    ONLINE_REL_BOUNDS allows."""
    blocks = _blocks_of(got) if isinstance(got, torch.Tensor) else got
    if isinstance(source, DenseWeight):
        bound = DENSE_CAST_REL_BOUND if online is None else ONLINE_REL_BOUNDS[online]
        w = source.weight
        return _compare_float_rows(blocks, lambda rows: w[rows], w.shape[0], bound, try_exact=online is None)
    online_fp8 = online == "fp8"
    if isinstance(source, IntWeight) and not online_fp8:
        return _compare_int_rows(blocks, source, act_dtype)
    ref = source.dequantize()
    bound = FP8_REL_BOUND if (online_fp8 or isinstance(source, Fp8Weight)) else DENSE_CAST_REL_BOUND
    if isinstance(source, Fp4Weight):
        bound = FP4_MARLIN_FLUSH_REL_BOUND
    return _compare_float_rows(blocks, lambda rows: ref[rows], ref.shape[0], bound, try_exact=True)


def compare_fp8_measured(
    stored: Fp8Weight | None, quantized: SourceWeight, error: QuantError | None
) -> LayerVerification | None:
    """A layer quantized online to FP8 (`quantize_fp8_measured`) whose kernel stores its codes and
    scales unchanged (`LinearKernel.stored_fp8_weight`): the stored bytes against the quantizer's,
    exactly, and the error the quantizer measured over every element against the online-FP8 bound —
    what dequantizing the stored layer and comparing it with the source would give, without a second
    pass over the weight. None: verify by dequantizing."""
    if stored is None or error is None or not isinstance(quantized, Fp8Weight):
        return None
    if stored.weight.shape != quantized.weight.shape:
        return _mismatch()
    same_codes = _same_view(stored.weight, quantized.weight) or torch.equal(
        stored.weight.view(torch.uint8), quantized.weight.view(torch.uint8)
    )
    scales = stored.scale.float().reshape(-1), quantized.scale.float().reshape(-1)
    if not same_codes or not torch.equal(*scales):
        return LayerVerification(ok=False, metric="exact", value=float("inf"), bound=0.0)
    bound = ONLINE_REL_BOUNDS["fp8"]
    f32 = torch.float32  # the ratio in float32, as `_compare_float_rows` takes it
    value = float(
        torch.tensor(error.diff_max, dtype=f32) / torch.tensor(error.ref_max, dtype=f32).clamp_min(_TINY)
    )
    if value != value:  # NaN (a non-finite weight) never passes
        value = float("inf")
    return LayerVerification(ok=value <= bound, metric="max_rel_err", value=value, bound=bound)


def _compare_int_rows(
    blocks: Iterable[tuple[slice, torch.Tensor]], source: IntWeight, act_dtype: torch.dtype
) -> LayerVerification:
    """Row blocks of a dequantized integer layer against the source's dequantization, with its scales
    as stored in the checkpoint or cast to the activation dtype (what vLLM's loader does): "exact"
    when every block equals one of the two, else the smaller of the two worst excesses, in steps."""
    refs = [source]
    if source.scales.dtype != act_dtype:
        refs.append(dataclasses.replace(source, scales=source.scales.to(act_dtype), bias=None))
    exact = [True] * len(refs)
    worst = [float("-inf")] * len(refs)
    gi = source.group_index()
    covered = 0
    for rows, g in blocks:
        g = g.float()
        allowance: tuple[torch.Tensor, torch.Tensor] | None = None
        for i, src in enumerate(refs):
            r = src.rows(rows).dequantize()
            if g.shape != r.shape:
                return _mismatch()
            if torch.equal(g, r):
                continue
            exact[i] = False
            if allowance is None:
                part = source.rows(rows)
                step = part.scales.float()[gi].T.abs().clamp_min(_TINY)  # (rows, K)
                allowance = step, rounding_allowance(part, gi, step)
            step, rounding = allowance
            worst[i] = max(worst[i], float(((g - r).abs_() / step - rounding).max()))
        covered += g.shape[0]
    if covered != source.codes.shape[0]:
        return _mismatch()
    if any(exact):
        return _exact()
    value = max(0.0, min(worst))  # every element within its allowance: 0 (a float minimum's is > 0)
    if value != value:
        value = float("inf")
    return LayerVerification(
        ok=value <= INT_STEP_BOUND, metric="max_step_err", value=value, bound=INT_STEP_BOUND
    )


def worst_of(a: LayerVerification | None, b: LayerVerification) -> LayerVerification:
    """The worse of two checks (any inexact one is worse than an exact one): a layer's record."""
    if a is None or (b.metric != "exact" and (a.metric == "exact" or b.value > a.value)):
        return b
    return a
