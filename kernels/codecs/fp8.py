"""FP8 e4m3fn quantization with vLLM's semantics (docs/formats.md §5.2, §5.3) and an exact e4m3 rounding.

Strategies (all scales are multipliers, w ~= q * scale, float32):
* "tensor":  scale = amax / 448 per shard (one per entry of `shard_sizes`, as a checkpoint holding
             q/k/v or gate/up separately would have), no lower clamp; q = cvt(clamp(w * (1/scale))).
* "channel": scale = amax(row) / 448, same reciprocal multiply.
* "block":   DeepGEMM's per_block_cast_to_fp8: zero-pad to whole blocks, amax per block clamped at
             1e-4, sf = amax / 448, q = (w * (1/sf)).to(fp8); sf (ceil(N/bn), ceil(K/bk)).
`quantize_fp8_measured` (tensor, channel) also returns the quantization's error, max |q * scale - w|
over every element with max |w|, computed chunk by chunk while each chunk's float32 copy is still in
cache (verification of an online-FP8 layer whose kernel stores the codes as they are needs nothing else).
Zero rows / shards (tensor, channel): amax 0 gives scale 0 (vLLM's per-tensor path has no clamp);
there we emit code 0 instead of the NaN that `0 * (1/0)` would give, so the dequantized weight is
exactly 0. vLLM's CUDA clamp drops that NaN to 448, which also dequantizes to 0 * 448 = 0.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.base import Fp8Strategy, Fp8Weight
from kernels.codecs.native_fp8 import native_fp8
from kernels.codecs.word_ops import for_each_block, hugepage_empty, serial_ops
from kernels.errors import LayoutError

E4M3_MAX = 448.0
BLOCK_AMAX_FLOOR = 1e-4  # per_block_cast_to_fp8's clamp
# float32 value of every e4m3fn byte (NaN at 0x7F / 0xFF), a gather table for dequantizing codes
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E4M3_MIN_NORMAL = 2.0**-6
_E4M3_SUBNORMAL_STEP = 2.0**-9
_CHUNK_ELEMS = 1 << 18  # float32 working set per step of the row-chunked quantizers


@dataclass(frozen=True)
class QuantError:
    """A quantized weight's error against its source, over every element."""

    diff_max: float  # max |dequantized - source|
    ref_max: float  # max |source|


def quantize_fp8_measured(
    w: torch.Tensor, strategy: Fp8Strategy, *, shard_sizes: tuple[int, ...] = ()
) -> tuple[Fp8Weight, QuantError]:
    """`quantize_fp8` ("tensor" / "channel") and its error (module docstring), in the same pass."""
    if strategy not in ("tensor", "channel"):
        raise LayoutError(f"the measured FP8 quantizer takes tensor or channel scales, not {strategy!r}")
    _check_2d_float(w)
    with serial_ops():
        q, error = _quantize_static(w, strategy, shard_sizes, measure=True)
    assert error is not None
    return q, error


def quantize_fp8(
    w: torch.Tensor,
    strategy: Fp8Strategy,
    *,
    block_size: tuple[int, int] = (128, 128),
    shard_sizes: tuple[int, ...] = (),
) -> Fp8Weight:
    """(N, K) float weight -> `Fp8Weight` (e4m3fn codes + float32 multiplier scales).

    Row blocks run on torch.get_num_threads() Python threads with one intra-op thread each
    (kernels/codecs/word_ops.py `for_each_block`), so a busy machine does not stall OpenMP teams.
    """
    _check_2d_float(w)
    with serial_ops():
        if strategy in ("tensor", "channel"):
            return _quantize_static(w, strategy, shard_sizes, measure=False)[0]
        if strategy == "block":
            q, sf = _block_quant(w, block_size)
            return Fp8Weight(weight=q, scale=sf, strategy="block", block_size=tuple(block_size))
    raise LayoutError(f"unknown FP8 strategy {strategy!r}; use 'tensor', 'channel' or 'block'")


def _check_2d_float(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise LayoutError(f"FP8 quantization needs a 2-D float weight, got {w.dtype} {tuple(w.shape)}")


def _quantize_static(
    w: torch.Tensor, strategy: Fp8Strategy, shard_sizes: tuple[int, ...], *, measure: bool
) -> tuple[Fp8Weight, QuantError | None]:
    """Per-tensor (per shard) or per-channel scales from the rows' amax, then `_static_quant`."""
    n = w.shape[0]
    rows_amax = _row_amax(w)  # (N,) float32
    if strategy == "tensor":
        sizes = tuple(shard_sizes) or (n,)
        if sum(sizes) != n:
            raise LayoutError(f"shard_sizes {sizes} sum to {sum(sizes)}, but the weight has N={n} rows")
        amax = torch.stack([part.max() for part in torch.split(rows_amax, list(sizes))])
        scale = amax / E4M3_MAX  # (S,) float32
        row_scale = torch.repeat_interleave(scale, torch.tensor(sizes))[:, None]
    else:
        scale = rows_amax / E4M3_MAX  # (N,) float32
        row_scale = scale[:, None]
    errors: list[float] | None = [] if measure else None
    q = _static_quant(w, row_scale, errors)
    weight = Fp8Weight(weight=q, scale=scale, strategy=strategy, shard_sizes=tuple(shard_sizes))
    if errors is None:
        return weight, None
    diff_max = float("nan") if any(e != e for e in errors) else max(errors, default=0.0)
    return weight, QuantError(diff_max, float(rows_amax.max()) if n else 0.0)


def _row_amax(w: torch.Tensor) -> torch.Tensor:
    """(N, K) float -> (N,) float32 max |w| per row (an empty row gives 0; NaN when a row has one).

    On the bit patterns: clearing the sign bit orders |w| as signed integers (NaN above inf), so one
    integer max per row, several times faster than a float min and max."""
    n, k = w.shape
    out = torch.zeros(n, dtype=torch.float32)
    if k == 0:
        return out
    native = _native_absmax(w, out)
    if native is not None:
        for_each_block(n, k * w.element_size(), native)
        return out
    bits_dtype = {2: torch.int16, 4: torch.int32}.get(w.element_size())
    if bits_dtype is None or not w.is_contiguous():
        bits_dtype = None
    magnitude = (1 << (8 * w.element_size() - 1)) - 1

    def block(blk: slice) -> None:
        part = w[blk]
        if bits_dtype is None:
            torch.maximum(-part.amin(dim=1).float(), part.amax(dim=1).float(), out=out[blk])
            return
        bits = torch.bitwise_and(part.view(bits_dtype), magnitude)
        out[blk] = bits.amax(dim=1).view(w.dtype).float()

    for_each_block(n, k * w.element_size(), block)
    return out


def requantize_to_max_scale(w: Fp8Weight) -> Fp8Weight:
    """vLLM's `requantize_with_max_scale`: fused per-tensor shards -> one scale (max over shards).

    Each shard is dequantized as vLLM's `per_tensor_dequantize` does on the GPU: `weight.to(float16)
    * scale[i]` with `scale[i]` a 0-dim CUDA tensor, so type promotion gives float16 and the CUDA
    kernel loads the scale cast to float16: fp16(float(q16) * float(fp16(s))). (On CPU a 0-dim tensor
    is a "CPU scalar" kept in float32, so the scale is rounded to float16 explicitly here.) Then it is
    requantized with the static kernel: cvt(clamp(x * (1 / max_scale))). Bytes may change even when
    all shard scales are equal.
    """
    if w.strategy != "tensor":
        raise LayoutError(f"requantize_to_max_scale applies to per-tensor FP8 weights, not {w.strategy!r}")
    n, _ = w.weight.shape
    sizes = w.shard_sizes or (n,)
    scale = w.scale.float().reshape(-1)
    if len(sizes) != scale.numel():
        raise LayoutError(f"{scale.numel()} per-tensor scales for {len(sizes)} shards {sizes}")
    max_s = scale.max()
    scale16 = scale.to(torch.float16)
    parts = [part.to(torch.float16) * scale16[i] for i, part in enumerate(torch.split(w.weight, list(sizes)))]
    deq = torch.cat(parts).float()
    q = _static_quant(deq, max_s.reshape(1, 1))
    return Fp8Weight(weight=q, scale=max_s.reshape(1), strategy="tensor", bias=w.bias)


def round_to_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 values exactly representable in e4m3fn: RNE, saturating at ±448, NaN kept.

    Normals (|x| >= 2^-6): add the round-to-nearest-even bias to the fp32 bit pattern and clear all
    but 3 mantissa bits. Subnormals: round to a multiple of 2^-9 (torch.round is half-to-even).
    Casting the result to float8_e4m3fn is then exact, which sidesteps the Triton interpreter's
    faulty fp32 -> e4m3 downcast (docs/formats.md §17.1).
    """
    if x.dtype != torch.float32:
        raise LayoutError(f"round_to_e4m3_grid takes float32, got {x.dtype}")
    c = x.clamp(-E4M3_MAX, E4M3_MAX)
    bits = c.view(torch.int32)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).view(torch.float32)
    sub = torch.round(c / _E4M3_SUBNORMAL_STEP) * _E4M3_SUBNORMAL_STEP
    out = torch.where(c.abs() < _E4M3_MIN_NORMAL, sub, normal)
    return torch.where(torch.isnan(x), x, out)


def _static_quant(w: torch.Tensor, scale: torch.Tensor, errors: list[float] | None = None) -> torch.Tensor:
    """cvt_e4m3(clamp(w * (1/scale), ±448)) in float32, `scale` (N, 1) per row; a zero scale gives code 0.

    Works through row chunks of about _CHUNK_ELEMS so the float32 temporaries stay small. With
    `errors`, each block appends max |q * scale - w| over its rows (NaN when a weight is not finite).
    """
    n, k = w.shape
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale).expand(n, 1)
    row_scale = scale.expand(n, 1)
    out = hugepage_empty((n, k), torch.uint8).view(torch.float8_e4m3fn)
    lock = threading.Lock()
    native = _native_rows(w, inv, row_scale, out, errors)

    def block(blk: slice) -> None:
        if native is not None:
            worst_native = native(blk)
            if errors is not None:
                with lock:
                    errors.append(worst_native)
            return
        rows = max(1, _CHUNK_ELEMS // max(k, 1))
        buf = torch.empty(min(rows, blk.stop - blk.start), k, dtype=torch.float32)
        idx = torch.empty(buf.numel() if errors is not None else 0, dtype=torch.int32)
        worst = torch.zeros((), dtype=torch.float32)
        for r0 in range(blk.start, blk.stop, rows):
            r1 = min(blk.stop, r0 + rows)
            x = buf[: r1 - r0]
            torch.mul(w[r0:r1], inv[r0:r1], out=x)  # float(w) * fp32 reciprocal
            x.clamp_(-E4M3_MAX, E4M3_MAX)
            out[r0:r1] = x
            if errors is not None:  # the chunk dequantized and compared while it is in cache
                codes = idx[: (r1 - r0) * k]
                codes.copy_(out[r0:r1].view(torch.uint8).reshape(-1))
                torch.index_select(E4M3_VALUES, 0, codes, out=x.view(-1))  # 5x torch's fp8 -> fp32
                x.mul_(row_scale[r0:r1]).sub_(w[r0:r1])
                lo, hi = torch.aminmax(x)
                worst = torch.maximum(worst, torch.maximum(-lo, hi))  # NaN propagates
        if errors is not None:
            with lock:
                errors.append(float(worst))

    for_each_block(n, k * w.element_size(), block)
    return out


_NATIVE_ROWS = {torch.bfloat16: "kiln_fp8_quantize_bf16", torch.float32: "kiln_fp8_quantize_f32"}
_NATIVE_ABSMAX = {torch.bfloat16: "kiln_row_absmax_bf16", torch.float32: "kiln_row_absmax_f32"}


def _native_fn(w: torch.Tensor, names: dict[torch.dtype, str]) -> Any:
    """The native function for `w`'s rows (bf16 / float32, contiguous within a row, on the CPU), or
    None (the torch path runs)."""
    name = names.get(w.dtype)
    if name is None or w.stride(1) != 1 or w.device.type != "cpu" or w.shape[1] == 0:
        return None
    lib = native_fp8()
    return None if lib is None else getattr(lib, name)


def _native_absmax(w: torch.Tensor, out: torch.Tensor) -> Callable[[slice], None] | None:
    """`_row_amax`'s block in native code, or None."""
    fn = _native_fn(w, _NATIVE_ABSMAX)
    if fn is None:
        return None
    k, stride, item, base = w.shape[1], w.stride(0), w.element_size(), w.data_ptr()

    def rows(blk: slice) -> None:
        fn(base + blk.start * stride * item, blk.stop - blk.start, k, stride, out.data_ptr() + 4 * blk.start)

    return rows


def _native_rows(
    w: torch.Tensor,
    inv: torch.Tensor,
    row_scale: torch.Tensor,
    out: torch.Tensor,
    errors: list[float] | None,
) -> Callable[[slice], float] | None:
    """`_static_quant`'s block in native code (kernels/codecs/native_fp8.py), for bf16 / float32 rows
    laid out contiguously: the block's rows quantized into `out`, their max error returned (NaN
    above inf). None: the torch path runs (another dtype or layout, or no native build)."""
    fn = _native_fn(w, _NATIVE_ROWS)
    if fn is None:
        return None
    n, k = w.shape
    inv_rows = inv.reshape(n).float().contiguous()
    scale_rows = row_scale.reshape(n).float().contiguous()
    stride, item = w.stride(0), w.element_size()
    base, out_base = w.data_ptr(), out.data_ptr()
    measure = int(errors is not None)

    def rows(blk: slice) -> float:
        worst = fn(
            base + blk.start * stride * item, blk.stop - blk.start, k, stride,
            inv_rows.data_ptr() + 4 * blk.start, scale_rows.data_ptr() + 4 * blk.start,
            out_base + blk.start * k, measure,
        )  # fmt: skip
        return struct.unpack("<f", struct.pack("<I", worst))[0]  # the max error's float bits

    return rows


def _block_quant(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """per_block_cast_to_fp8, one row of blocks at a time (zero padding only inside the buffer)."""
    bn, bk = block_size
    if bn <= 0 or bk <= 0:
        raise LayoutError(f"FP8 block size must be positive, got {block_size}")
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    out = hugepage_empty((n, k), torch.uint8).view(torch.float8_e4m3fn)
    sf = torch.empty(nb, kb, dtype=torch.float32)

    def block(blk: slice) -> None:
        buf = torch.zeros(bn, kb * bk, dtype=torch.float32)
        for i in range(blk.start, blk.stop):
            r0, r1 = i * bn, min(n, (i + 1) * bn)
            if r1 - r0 < bn or k < kb * bk:
                buf.zero_()
            buf[: r1 - r0, :k] = w[r0:r1]
            view = buf.view(bn, kb, bk)
            amax = torch.maximum(view.amax(dim=(0, 2)), -view.amin(dim=(0, 2))).clamp_(BLOCK_AMAX_FLOOR)
            sf[i] = amax / E4M3_MAX
            view.mul_((1.0 / sf[i])[None, :, None])
            out[r0:r1] = buf[: r1 - r0, :k]

    for_each_block(nb, bn * k * w.element_size(), block)
    return out, sf
