"""cpu_int4: 4-bit weight-only GEMM on CPU through torch's tinygemm port.

Runs `torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, group, scales_and_zeros)` on weights
packed by `torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes (N, K) int32, inner_k_tiles)`.

Facts measured on torch 2.13 (CPU):
- The matmul dequantizes `w = (q - 8) * scale + zero` in fp32 (q the unsigned 4-bit code), so a
  checkpoint's `w = (q - z) * s` maps to scale `s` and zero `(8 - z) * s` (symmetric: zero 0).
- x, scales_and_zeros and the output share one dtype. Only bf16 has a vectorized kernel: on a
  2048x2048 layer at M=1 bf16 took ≈0.08 ms, fp32 ≈4 ms, fp16 ≈5 ms. So activations run in bf16
  (the kernel accumulates in fp32; the output is rounded to bf16).
- The group size must be 32, 64, 128 or 256 and divide K; N must be a multiple of 16. A checkpoint
  group that is a multiple of a supported size (channelwise: K) is split into equal op groups with
  the scale repeated, which is exact.
- The packed byte layout depends on the CPU capability torch dispatches to: full blocks of 64 rows
  pair rows (d, d + 32) in one byte on AVX512, blocks of 32 pair (d, d + 16) on AVX2, and tail
  blocks / the scalar build pair adjacent rows (2j, 2j + 1). `pack_format` records which layout
  `qweight` holds; `apply` repacks once (in the caller's tensor dict) when the runtime CPU differs.

Exactness: scales are rounded to bf16 (the kernel's only lossy step: ≤ 2^-8 relative; none for bf16
checkpoints). The asymmetric term `(8 - z) * s` is not representable in bf16, so it is not put in
the kernel's zero column: it is stored in fp32 as `zero_offsets` and added as
`group_sums(x) @ zero_offsets` (an (M, G) x (G, N) product), which keeps (q - z) * s exact.

Stored tensors:
    qweight          (N, K // 2) uint8          torch's CPU int4 pack of the unsigned codes
    pack_format      (2,) int32                 [block_n, split] of that pack (see above)
    scales_and_zeros (K // group, N, 2) bf16    [..., 0] scale, [..., 1] zero (always 0 here);
                                                group = the op group size (32/64/128/256)
    zero_offsets     (G, N) float32             (2**(bits-1) - z) * s per checkpoint group, or 8 * s + m
                                                for a float minimum m (GGUF Q4_1 / Q4_K); asymmetric only
    perm             (K,) int32                 act-order only: stable argsort of g_idx (x[..., perm] first)
    bias             (N,) float32               optional
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache

import torch

from kernels.base import (
    ALL_ROWS,
    CpuKernel,
    IntWeight,
    LinearSpec,
    RowBlocks,
    SourceWeight,
    StoredTensor,
    Target,
    row_block_slices,
    with_bias,
)
from kernels.errors import LayoutError

log = logging.getLogger(__name__)

OP_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
INNER_K_TILES = 2  # ignored by the CPU pack (the layout is the same for 2, 4 and 8)
MIDPOINT = 8  # the kernel's implicit zero: dequant is (q - 8) * scale + zero

# (block_n, split) layouts torch may use, checked in this order against the running build.
PACK_FORMATS: tuple[tuple[int, bool], ...] = ((64, True), (32, True), (32, False), (16, False), (64, False))


def op_group_size(k: int, group_size: int) -> int | None:
    """Largest op group size that tiles one checkpoint group exactly (None if there is none)."""
    g = k if group_size in (-1, 0) else group_size
    return next((d for d in OP_GROUP_SIZES if g % d == 0 and k % d == 0), None)


def pack_int4(codes: torch.Tensor, block_n: int, split: bool) -> torch.Tensor:
    """(N, K) codes in [0, 16) -> (N, K // 2) uint8 in torch's CPU int4 layout `(block_n, split)`.

    Rows are cut into blocks of `block_n` (the last may be shorter); block b occupies bytes
    [b0 * K / 2, (b0 + nb) * K / 2) as a (K, nb / 2) array: byte d of column k holds row
    `d` (low nibble) and row `d + nb / 2` (high) when `split` and the block is full, else rows
    `2d` and `2d + 1`.
    """
    n, k = codes.shape
    c = codes.to(torch.uint8)
    out = torch.empty(n * k // 2, dtype=torch.uint8)
    full = n // block_n * block_n
    for start, rows, is_full in ((0, full, True), (full, n - full, False)):
        if rows == 0:
            continue
        nb = block_n if is_full else rows
        blk = c[start : start + rows].reshape(rows // nb, nb, k)
        if split and is_full:
            lo, hi = blk[:, : nb // 2], blk[:, nb // 2 :]
        else:
            lo, hi = blk[:, 0::2], blk[:, 1::2]
        byte = lo | (hi << 4)  # (blocks, nb / 2, K)
        out[start * k // 2 : (start + rows) * k // 2] = byte.transpose(1, 2).reshape(-1)
    return out.reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor, n: int, k: int, block_n: int, split: bool) -> torch.Tensor:
    """Inverse of `pack_int4`: (N, K // 2) uint8 -> (N, K) uint8 codes."""
    flat = packed.reshape(-1)
    out = torch.empty(n, k, dtype=torch.uint8)
    full = n // block_n * block_n
    for start, rows, is_full in ((0, full, True), (full, n - full, False)):
        if rows == 0:
            continue
        nb = block_n if is_full else rows
        byte = flat[start * k // 2 : (start + rows) * k // 2].reshape(rows // nb, k, nb // 2).transpose(1, 2)
        lo, hi = byte & 0xF, byte >> 4  # (blocks, nb / 2, K)
        blk = out[start : start + rows].view(rows // nb, nb, k)
        if split and is_full:
            blk[:, : nb // 2], blk[:, nb // 2 :] = lo, hi
        else:
            blk[:, 0::2], blk[:, 1::2] = lo, hi
    return out


@cache
def runtime_pack_format() -> tuple[int, bool]:
    """The layout this process's torch build packs and reads (probed once on a small weight)."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (112, 8), generator=gen, dtype=torch.int32)  # 112 = 64 + 32 + 16 rows
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, INNER_K_TILES)
    for block_n, split in PACK_FORMATS:
        if torch.equal(pack_int4(probe, block_n, split), packed.reshape(112, 4)):
            return block_n, split
    raise LayoutError(
        "torch's CPU int4 pack uses a layout cpu_int4 does not know "
        f"(torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}); "
        "disable cpu_int4 (KILN_DISABLED_KERNELS=cpu_int4) to use the dense fallback"
    )


def stored_pack_format(tensors: dict[str, torch.Tensor]) -> tuple[int, bool]:
    block_n, split = tensors["pack_format"].tolist()
    return int(block_n), bool(split)


def act_order_permutation(weight: IntWeight, spec: LinearSpec, name: str) -> torch.Tensor | None:
    """(K,) int64 stable argsort of g_idx when it is not k // group_size, else None.

    Every group must have exactly group_size members so the sorted groups are contiguous.
    """
    if weight.g_idx is None:
        return None
    g_idx = weight.g_idx.long()
    k = g_idx.numel()
    channelwise = weight.group_size in (-1, 0)
    in_order = torch.zeros(k, dtype=torch.long) if channelwise else torch.arange(k) // weight.group_size
    if torch.equal(g_idx, in_order):
        return None
    if channelwise:
        raise LayoutError(f"{name}: layer {spec.name} is channelwise but has a non-trivial g_idx")
    counts = torch.bincount(g_idx, minlength=spec.num_groups)
    if counts.numel() != spec.num_groups or bool((counts != weight.group_size).any()):
        raise LayoutError(
            f"{name}: layer {spec.name} act-order g_idx does not give every group exactly "
            f"{weight.group_size} input channels (counts {counts.tolist()[:8]}...); "
            "the dense kernel can take this layer (disable cpu_int4 for it)"
        )
    return torch.argsort(g_idx, stable=True)


def request_amx_permission() -> bool:
    """Let this process run AMX tiles, on CPUs that have them (True then). torch's int4 matmul takes
    an AMX path for bf16 activations there, and Linux lets a process use AMX only once it asked
    (arch_prctl ARCH_REQ_XCOMP_PERM); inside vLLM's engine nothing has asked by the first int4 call,
    which then dies of SIGILL. Idempotent and cheap; a no-op without AMX."""
    return bool(torch.cpu._init_amx())


class CpuInt4Kernel(CpuKernel):
    name = "cpu_int4"
    layout_version = 1
    schemes = frozenset({"int"})
    description = "4-bit weight-only, torch's CPU int4 pack + _weight_int4pack_mm_for_cpu (bf16 activations)"
    takes_float_zeros = True

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.bits != 4:
            return False, f"cpu_int4 takes 4-bit weights only (layer has {spec.bits} bits)"
        if spec.n % N_MULTIPLE:
            return False, f"N={spec.n} is not a multiple of {N_MULTIPLE} (torch's CPU int4 pack)"
        if spec.group_size > 0 and spec.k % spec.group_size:
            return False, f"K={spec.k} is not a multiple of group size {spec.group_size}"
        if op_group_size(spec.k, spec.group_size) is None:
            what = f"K={spec.k}" if spec.group_size in (-1, 0) else f"group size {spec.group_size}"
            return False, (
                f"{what} is not a multiple of 32: torch's CPU int4 matmul takes groups of 32/64/128/256"
            )
        if spec.act_order and spec.k != spec.k_full:
            return False, "act-order with a row-parallel split: a rank holds partial groups"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k = spec.n, spec.k
        op_group = op_group_size(k, spec.group_size) or k
        out = {
            "qweight": StoredTensor((n, k // 2), torch.uint8),
            "pack_format": StoredTensor((2,), torch.int32),
            "scales_and_zeros": StoredTensor((k // op_group, n, 2), torch.bfloat16),
        }
        if not spec.symmetric:
            out["zero_offsets"] = StoredTensor((spec.scale_groups, n), torch.float32)
        if spec.act_order:  # stored only when g_idx is not the trivial k // group_size
            out["perm"] = StoredTensor((k,), torch.int32, optional=True)
        return with_bias(out, spec, torch.float32)

    def neutral_tensor(self, suffix: str, spec: LinearSpec) -> torch.Tensor:
        if suffix == "perm":  # the identity: input channels already in group order
            return torch.arange(spec.k, dtype=torch.int32)
        return super().neutral_tensor(suffix, spec)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        w = self.prepare_input(weight, IntWeight, spec)
        if w.codes.numel() and int(w.codes.max()) >= 1 << w.bits:
            raise LayoutError(f"{self.name}: layer {spec.name} has codes >= {1 << w.bits} for {w.bits} bits")
        n, k = spec.n, spec.k
        op_group = op_group_size(k, w.group_size)
        if op_group is None or n % N_MULTIPLE:
            raise LayoutError(f"{self.name}: layer {spec.name} shape/group not supported; see can_implement")
        codes = w.codes
        perm = act_order_permutation(w, spec, self.name)
        if perm is not None:
            codes = codes[:, perm]
        num_groups = w.scales.shape[0]
        if tuple(w.scales.shape) != (k // (k if w.group_size in (-1, 0) else w.group_size), n):
            raise LayoutError(
                f"{self.name}: layer {spec.name} scales have shape {tuple(w.scales.shape)}, expected (G, N) "
                f"for group size {w.group_size}"
            )
        scales = w.scales.float()  # (G, N)
        repeat = k // num_groups // op_group
        scale_bf16 = scales.to(torch.bfloat16).repeat_interleave(repeat, dim=0)  # (K // op_group, N)
        block_n, split = runtime_pack_format()
        tensors = {
            "qweight": pack_for_this_cpu(codes),  # (N, K // 2) uint8
            "pack_format": torch.tensor([block_n, int(split)], dtype=torch.int32),
            "scales_and_zeros": torch.stack([scale_bf16, torch.zeros_like(scale_bf16)], dim=-1).contiguous(),
        }
        if w.zeros is not None:
            tensors["zero_offsets"] = (MIDPOINT - w.zeros.float()) * scales  # (G, N), exact in fp32
        elif w.mins is not None:  # q * s + m = (q - 8) * s + (8 * s + m)
            tensors["zero_offsets"] = MIDPOINT * scales + w.mins.float()  # (G, N)
        if perm is not None:
            tensors["perm"] = perm.to(torch.int32)
        if w.bias is not None:
            tensors["bias"] = w.bias.float()
        return tensors

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        return _dequantize_rows(tensors, spec, slice(0, spec.n))

    def dequantized_rows(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> RowBlocks:
        for rows in row_block_slices(spec.n, spec.k):  # whole pack blocks: multiples of 64 rows
            yield rows, _dequantize_rows(tensors, spec, rows)

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if stored_pack_format(tensors) != runtime_pack_format():
            _repack_for_this_cpu(tensors, spec)
        k, n = spec.k, spec.n
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if "perm" in tensors:
            x2 = x2.index_select(-1, tensors["perm"])
        sz = tensors["scales_and_zeros"]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(torch.bfloat16).contiguous(), tensors["qweight"], k // sz.shape[0], sz
        )
        offsets = tensors.get("zero_offsets")
        bias = tensors.get("bias")
        if offsets is not None or bias is not None:
            yf = y.float()
            if offsets is not None:
                g = offsets.shape[0]
                yf = yf + x2.float().reshape(-1, g, k // g).sum(-1) @ offsets
            if bias is not None:
                yf = yf + bias
            y = yf
        return y.to(x.dtype).reshape(*lead, n)

    def bf16_op_rows(self) -> int:
        return ALL_ROWS  # the op is bf16 in and out at every batch

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec, *, exact_zero_offsets: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """`apply` with everything resolved once (the runtime's hot path): repacks for this CPU now
        if needed, then each call is one op (plus the bias).

        Asymmetric layers: the zero offsets `(8 - z) * s` go into the op's zero column rounded to
        bf16 (a (K // op_group, N, 2) copy of `scales_and_zeros`, ≈1/16 of the packed weight)
        instead of the exact fp32 `group_sums(x) @ zero_offsets` term `apply` adds. That moves a
        weight by ≤ 2^-9 |(8 - z) s| ≤ s / 64 (a 64th of a quantization step; the rounding itself
        is ≈ s / 3.5 rms) and saves four ops per call: ≈25 % of an AWQ SmolLM2 decode step.
        `exact_zero_offsets=True` keeps `apply`'s exact form."""
        request_amx_permission()
        if stored_pack_format(tensors) != runtime_pack_format():
            _repack_for_this_cpu(tensors, spec)
        k, n = spec.k, spec.n
        qweight, sz = tensors["qweight"], tensors["scales_and_zeros"]
        op_group = k // sz.shape[0]
        perm = tensors.get("perm")
        offsets = tensors.get("zero_offsets")  # (G, N) fp32
        bias = tensors.get("bias")
        groups = offsets.shape[0] if offsets is not None else 1
        if offsets is not None and not exact_zero_offsets:
            zero = offsets.to(torch.bfloat16).repeat_interleave(
                sz.shape[0] // groups, dim=0
            )  # (K // op_group, N)
            sz = torch.stack([sz[..., 0], zero], dim=-1).contiguous()  # (K // op_group, N, 2) bf16
            offsets = None
        int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        bf16 = torch.bfloat16

        if perm is None and offsets is None and bias is None:

            def run_plain(x: torch.Tensor) -> torch.Tensor:
                """The common layer: one op, plus the conversions a non-bf16 x needs."""
                x2 = x.reshape(-1, k)
                if x.dtype == bf16:
                    return int4_mm(x2.contiguous(), qweight, op_group, sz).view(*x.shape[:-1], n)
                y = int4_mm(x2.to(bf16).contiguous(), qweight, op_group, sz)
                return y.to(x.dtype).view(*x.shape[:-1], n)

            return run_plain

        def run(x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, k)
            if perm is not None:
                x2 = x2.index_select(-1, perm)
            if x2.dtype != bf16:
                x2 = x2.to(bf16)
            x2 = x2.contiguous()
            y = int4_mm(x2, qweight, op_group, sz)  # (M, N) bf16
            if offsets is not None:  # y + group_sums(x) @ zero_offsets, summed in fp32
                group_sums = x2.view(-1, groups, k // groups).sum(-1, dtype=torch.float32)  # (M, G)
                y = torch.addmm(y.float(), group_sums, offsets)
            if bias is not None:
                y = y.float().add_(bias)
            return y.to(x.dtype).view(*lead, n)

        return run


def pack_for_this_cpu(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 16) -> (N, K // 2) uint8 packed by this torch build, in row blocks of whole
    pack blocks (the int32 copy the op takes stays one block's size, not 4 bytes per weight)."""
    n, k = codes.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    for rows in row_block_slices(n, k):
        block = codes[rows].to(torch.int32).contiguous()
        out[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(block, INNER_K_TILES).view(-1, k // 2)
    return out


def _dequantize_rows(tensors: dict[str, torch.Tensor], spec: LinearSpec, rows: slice) -> torch.Tensor:
    """(rows, K) float32 of the stored layer; `rows` starts at a multiple of the pack's block."""
    start, stop, _ = rows.indices(spec.n)
    k = spec.k
    codes = unpack_int4(tensors["qweight"][start:stop], stop - start, k, *stored_pack_format(tensors))
    sz = tensors["scales_and_zeros"][:, start:stop].float()  # (K // op_group, rows, 2)
    op_group = k // sz.shape[0]
    scale = sz[..., 0].T.repeat_interleave(op_group, dim=1)  # (rows, K)
    zero = sz[..., 1].T.repeat_interleave(op_group, dim=1)
    w = torch.addcmul(zero, codes.float() - MIDPOINT, scale)  # (q - 8) * s is exact in fp32
    if "zero_offsets" in tensors:
        off = tensors["zero_offsets"][:, start:stop].float()  # (G, rows)
        w += off.T.repeat_interleave(k // off.shape[0], dim=1)
    if "perm" in tensors:
        out = torch.empty_like(w)
        out[:, tensors["perm"].long()] = w
        w = out
    return w


def _repack_for_this_cpu(tensors: dict[str, torch.Tensor], spec: LinearSpec) -> None:
    """The artifact was packed by a torch build with another CPU layout: repack once, in place."""
    stored = stored_pack_format(tensors)
    codes = unpack_int4(tensors["qweight"], spec.n, spec.k, *stored)
    here = runtime_pack_format()
    log.warning(
        "layer %s: int4 weights were packed for layout %s, this CPU uses %s; repacking in memory",
        spec.name,
        stored,
        here,
    )
    tensors["qweight"] = pack_for_this_cpu(codes)
    tensors["pack_format"] = torch.tensor([here[0], int(here[1])], dtype=torch.int32)
