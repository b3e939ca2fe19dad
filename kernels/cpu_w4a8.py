"""cpu_w4a8: 4-bit weights x 8-bit activations with integer dot products on CPU (W4A8).

cpu_int4 (torch's tinygemm port) widens every 4-bit code to fp32 and multiplies in fp32: on a
2-core Xeon the SmolLM2 decode step's int4 layers streamed at ≈21 GB/s, compute-bound, and at
batch 8-16 the fp32 FMA rate was the limit. This kernel quantizes the activations to int8 — per
token and weight group, sx = amax / 127, q = rint(x / sx) — and multiplies them with the codes as
they lie: `vpdpbusd` (AVX-512 VNNI, 16 rows x 4 k per instruction) or `vpmaddubsw` + `vpmaddwd`
(AVX2), scalar elsewhere; the body is picked at run time (kernels/native/w4a8_gemv.h). Each
group's integer sum is exact in int32; scales and offsets are applied in fp32:

    y[n] = sum_g (sx_g * scale[g, n]) * sum_k code[n, k] * q[k] + offset[g, n] * sx_g * sum_k q[k]

which is exactly `dequant(q) @ dequant(W).T` up to fp32 summation order — `reference` computes
that, with the activation quantization bit-identical to the library's.

It changes numerics (the activations lose ≈ 1/254 of their group's largest value per element), so
no checkpoint gets it by default: a conversion asks for it (`kiln convert --int8-activations`,
which marks the cpu target's 4-bit layers `int8_activations`), as does a checkpoint calibrated
for dynamic int8 activations (compressed-tensors W4A8). The perplexity cost is measured in
docs/ and the tests.

Without a C compiler the twin runs instead (correct, slow), after one warning.

Stored tensors:
    qweight  (N / 16, 8 K) uint8        row block b: (K / 8, 16, 4) bytes; byte j of row r in k
                                        chunk c holds the codes of k = 8c + j (low nibble) and
                                        8c + 4 + j (high)
    scales   (N / 16, G, 2, 16) float32 per row block and group: 16 scales, then 16 offsets;
                                        w = code * scale + offset (offset = -z * s, -8 * s when
                                        symmetric, or the GGUF float minimum m); exact in fp32
    bias     (N,) float32               optional
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.base import (
    CpuKernel,
    IntWeight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)
from kernels.errors import LayoutError
from kernels.native_build import NativeLibrary

NATIVE = Path(__file__).with_name("native")
SOURCE = NATIVE / "w4a8.c"
HEADER = NATIVE / "w4a8_gemv.h"
FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi", "-pthread")
BLOCK_ROWS = 16  # rows per block of the layout
CHUNK_K = 8  # k per 32-bit lane (two nibbles per byte, four bytes)
QMAX = 127  # activations in [-127, 127]: |code x q| sums of 4 fit vpmaddubsw's 16 bits
MIDPOINT = 8  # a symmetric 4-bit layer's implicit zero point
LEVELS = ("scalar", "avx2", "avx512_vnni")  # kiln_w4a8_level's bodies
PARALLEL_MIN_MACS = 1 << 21  # smaller calls run on the calling thread alone (a thread costs ≈ 20 µs)


class W4A8Weight(ctypes.Structure):
    """w4a8_gemv.h's w4a8_weight."""

    _fields_ = [
        ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("group", ctypes.c_int32),
        ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p),
    ]  # fmt: skip


def _declare(lib: ctypes.CDLL) -> None:
    lib.kiln_w4a8_level.argtypes = [ctypes.c_int]
    lib.kiln_w4a8_level.restype = ctypes.c_int
    # x, M, K, group, q, sx, csum
    lib.kiln_w4a8_quantize.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 3, *[ctypes.c_void_p] * 3]
    lib.kiln_w4a8_quantize.restype = None
    lib.kiln_w4a8_apply.argtypes = [
        ctypes.POINTER(W4A8Weight), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    lib.kiln_w4a8_apply.restype = ctypes.c_int


LIBRARY = NativeLibrary(
    "cpu_w4a8 GEMV", SOURCE, FLAGS, _declare, libs=("-lm",), headers=(HEADER,), isa_function="kiln_w4a8_level"
)


def group_of(spec: LinearSpec) -> int:
    """The weight group (= activation group) along K: the whole K when channelwise."""
    return spec.k if spec.group_size in (-1, 0) else spec.group_size


def pack_w4a8(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 16) -> (N / 16, 8 K) uint8 in the layout above."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n // BLOCK_ROWS, BLOCK_ROWS, k // CHUNK_K, 2, 4)
    byte = c[..., 0, :] | (c[..., 1, :] << 4)  # (N/16, 16, K/8, 4)
    return byte.permute(0, 2, 1, 3).contiguous().reshape(n // BLOCK_ROWS, CHUNK_K * k)


def unpack_w4a8(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_w4a8`: (N / 16, 8 K) uint8 -> (N, K) uint8 codes."""
    byte = qweight.reshape(n // BLOCK_ROWS, k // CHUNK_K, BLOCK_ROWS, 4).permute(0, 2, 1, 3)
    return torch.stack([byte & 0xF, byte >> 4], dim=3).reshape(n, k)


def block_scales(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(G, N) fp32 scales and offsets -> (N / 16, G, 2, 16) fp32."""
    g, n = scales.shape
    both = torch.stack([scales, offsets]).reshape(2, g, n // BLOCK_ROWS, BLOCK_ROWS)
    return both.permute(2, 1, 0, 3).contiguous()


def group_scales(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `block_scales`: (N / 16, G, 2, 16) -> (G, N) scales, (G, N) offsets."""
    blocks, g = stored.shape[:2]
    both = stored.permute(2, 1, 0, 3).reshape(2, g, blocks * BLOCK_ROWS)
    return both[0], both[1]


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, K) float -> q (M, K) int8, sx (M, G) and csum = sx * sum(q) (M, G) fp32: bit for bit
    what the library multiplies (true fp32 division, ties to even, a zero group all zeros)."""
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    amax = xg.abs().amax(-1)  # (M, G)
    nonzero = amax > 0
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    inv = torch.full_like(safe, float(QMAX)) / safe  # `127 / t` would multiply by t's reciprocal
    q = torch.round(xg * inv[..., None]).clamp_(-QMAX, QMAX)
    q = torch.where(nonzero[..., None], q, torch.zeros_like(q))
    sx = torch.where(nonzero, amax / torch.full_like(amax, float(QMAX)), torch.zeros_like(amax))
    csum = sx * q.sum(-1)  # the integer sum is exact in fp32 (|sum| <= 127 * group)
    return q.to(torch.int8).reshape(m, k), sx, csum


def dequantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """(M, K) fp32: the activations the kernel multiplies, q * sx."""
    q, sx, _ = quantize_activations(x, group)
    m, k = q.shape
    return (q.float().reshape(m, k // group, group) * sx[..., None]).reshape(m, k)


class CpuW4A8Kernel(CpuKernel):
    name = "cpu_w4a8"
    layout_version = 1
    schemes = frozenset({"int"})
    takes_float_zeros = True
    description = (
        "4-bit weights x per-group int8 activations, integer dot products (VNNI / AVX2); "
        "layers marked int8_activations (kiln convert --int8-activations)"
    )

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if not spec.int8_activations:
            return False, "cpu_w4a8 takes layers converted for int8 activations only (--int8-activations)"
        if spec.bits != 4:
            return False, f"cpu_w4a8 takes 4-bit weights only (layer has {spec.bits} bits)"
        if spec.n % BLOCK_ROWS:
            return False, f"N={spec.n} is not a multiple of {BLOCK_ROWS} (cpu_w4a8's row blocks)"
        group = group_of(spec)
        if spec.k % group or group % CHUNK_K:
            return False, f"K={spec.k} / group size {group} are not multiples of {CHUNK_K} and of each other"
        if spec.act_order:
            return False, "act-order (a permuted input) has no cpu_w4a8 layout: cpu_int4 takes it"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k = spec.n, spec.k
        out = {
            "qweight": StoredTensor((n // BLOCK_ROWS, CHUNK_K * k), torch.uint8),
            "scales": StoredTensor((n // BLOCK_ROWS, k // group_of(spec), 2, BLOCK_ROWS), torch.float32),
        }
        return with_bias(out, spec, torch.float32)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        w = self.prepare_input(weight, IntWeight, spec)
        ok, reason = self.supports(spec, target)
        if not ok:
            raise LayoutError(f"{self.name}: layer {spec.name}: {reason}")
        if w.g_idx is not None and not torch.equal(w.group_index(), torch.arange(spec.k) // group_of(spec)):
            raise LayoutError(f"{self.name}: layer {spec.name} has an act-order g_idx; cpu_int4 takes it")
        if w.codes.numel() and int(w.codes.max()) >= 1 << w.bits:
            raise LayoutError(f"{self.name}: layer {spec.name} has codes >= {1 << w.bits} for {w.bits} bits")
        expected = (spec.k // group_of(spec), spec.n)
        if tuple(w.scales.shape) != expected:
            raise LayoutError(
                f"{self.name}: layer {spec.name} scales have shape {tuple(w.scales.shape)}, "
                f"expected {expected}"
            )
        scales = w.scales.float()  # (G, N)
        if w.zeros is not None:
            offsets = -w.zeros.float() * scales  # exact: a 4-bit integer times the scale
        elif w.mins is not None:
            offsets = w.mins.float()
        else:
            offsets = -MIDPOINT * scales
        tensors = {"qweight": pack_w4a8(w.codes), "scales": block_scales(scales, offsets)}
        if w.bias is not None:
            tensors["bias"] = w.bias.float()
        return tensors

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        codes = unpack_w4a8(tensors["qweight"], spec.n, spec.k).float()  # (N, K)
        scales, offsets = group_scales(tensors["scales"])  # (G, N)
        group = group_of(spec)
        s = scales.T.repeat_interleave(group, dim=1)
        o = offsets.T.repeat_interleave(group, dim=1)
        return torch.addcmul(o, codes, s)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return self.bind_apply(tensors, spec)(x)

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        lib = LIBRARY.get()
        if lib is None:
            return lambda x: self.reference(x, tensors, spec)
        k, n = spec.k, spec.n
        qweight, scales = tensors["qweight"].contiguous(), tensors["scales"].contiguous()
        bias = tensors.get("bias")
        weight = W4A8Weight(n, k, group_of(spec), qweight.data_ptr(), scales.data_ptr())
        pointer = ctypes.pointer(weight)
        keep = (qweight, scales)

        def run(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, k).float().contiguous()
            m = x2.shape[0]
            y = torch.empty(m, n, dtype=torch.float32)
            threads = torch.get_num_threads() if m * n * k >= PARALLEL_MIN_MACS else 1
            if lib.kiln_w4a8_apply(pointer, m, x2.data_ptr(), y.data_ptr(), threads) != 0:
                raise MemoryError(f"cpu_w4a8: no memory for the activations of {m} tokens ({keep[0].shape})")
            if bias is not None:
                y += bias
            return y.to(x.dtype).view(*x.shape[:-1], n)

        return run

    def reference(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        """Torch twin: the activations quantized exactly as the library does, then dequantized, times
        the dequantized weight in fp32."""
        xq = dequantized_activations(x.reshape(-1, spec.k), group_of(spec))
        y = xq @ self.dequantize(tensors, spec).T
        if "bias" in tensors:
            y = y + tensors["bias"].float()
        return y.to(x.dtype).reshape(*x.shape[:-1], spec.n)
