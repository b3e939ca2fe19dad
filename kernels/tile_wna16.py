"""tile_wna16: int2/4/5/6/8 weight-only GEMV / GEMM on Kiln's own GPU layout (Triton), every GPU target.

Written for `kiln serve` (conversions with `--gpu-layout kiln`); vLLM's plugin runs it with this same
kernel. Each output row's codes lie contiguous along K, so a program loads every int32 word once and
unpacks its 32 // bits codes with shifts (the Marlin-layout kernels gather one word per element).

Stored tensors (per rank; b = stored bits: the layer's, 8 for 5/6-bit codes; pf = 32 // b;
G = K // group_size, 1 channelwise):
    qweight  (N, K // pf) int32   row n's codes packed along K, standard order (code k of the row in
                                  bits [b * (k % pf), ...) of word k // pf); 5/6-bit codes (GGUF
                                  Q5_* / Q6_K) one per byte, symmetric ones moved to the 8-bit midpoint
                                  (bitpack.code_shift): exact, the kernel runs them as 8-bit codes
    scales   (G, N)       act     dequant multipliers
    zeros    (G, N)       uint8   asymmetric only: integer zero points, unpacked
    mins     (G, N)       act     float-minimum layers only (GGUF Q4_1 / Q4_K), instead of zeros
    codebook (16,)        fp32    value-table layers only (bitsandbytes NF4 / FP4, `tile_lut4`): the
                                  value of every code; their scales (the absmax) stay fp32
    perm     (K,)         int32   act-order only: the input channels sorted by group (stable); qweight's
                                  column j holds channel perm[j], so K block j // group is group j
    bias     (N,)         act     optional
    w[n, k] = (code - zero) * scale, symmetric zero = 2 ** (bits - 1); float minimum: code * scale + min;
    value table: codebook[code] * scale.

Each K block lies inside one group, so per block the kernel multiplies codes as integers and applies
the group once: acc += scale * (x · codes) + offset * sum(x), offset = -zero * scale (or the minimum).
M = 1 runs a GEMV program (multiply and reduce on the CUDA cores), larger M tensor-core tiles; split-K
by occupancy for decode shapes. Launch configs: kernels/launch_table.py. Act-order layers are stored
with K sorted by group (Marlin's idea): the kernel is the same, the activations are gathered by
`perm` first (one index_select); a rank holding a K slice of an act-order layer (row-parallel TP)
has groups of unequal size there and is left to marlin_wna16 / gptq_wna16.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import (
    DecodedLayoutKernel,
    IntWeight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)
from kernels.codecs.bitpack import (
    BYTE_STORED_BITS,
    from_stored_codes,
    pack_cols,
    stored_bits,
    to_stored_codes,
    unpack_cols,
)
from kernels.errors import LayoutError
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, operand_tiles
from kernels.jit import act_dtype_reason, jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, fit_to_groups
from kernels.launch_table import bound_configs, tuned_config
from kernels.targets import GPU_TARGETS

SUPPORTED_BITS = (2, 4, 8, *BYTE_STORED_BITS)
MIN_BLOCK_K = 16  # tl.dot's smallest K; a group must be a multiple of it
# OFFSET constexpr of the kernel: where a group's offset comes from (CODEBOOK: none, the codes index
# a value table)
SYMMETRIC, INT_ZEROS, FLOAT_MINS, CODEBOOK = 0, 1, 2, 3


def group_of(spec: LinearSpec) -> int:
    return spec.k if spec.group_size in (-1, 0) else spec.group_size


class TileWNA16Kernel(DecodedLayoutKernel):
    name: ClassVar[str] = "tile_wna16"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"int"})
    targets: ClassVar[frozenset[Target]] = GPU_TARGETS
    kiln_layout: ClassVar[bool] = True
    elsewhere: ClassVar[str] = "the cpu target uses cpu_w4a8 / cpu_int4 / cpu_int8"
    description: ClassVar[str] = "int2/4/5/6/8 weight-only, Kiln row-contiguous layout, Triton GEMV / GEMM"
    takes_float_zeros: ClassVar[bool] = True

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if spec.bits not in SUPPORTED_BITS:
            return False, f"tile_wna16 supports {SUPPORTED_BITS} bits, layer has {spec.bits}"
        if spec.act_order and spec.k != spec.k_full:
            return False, (
                f"act-order layer with K split over ranks ({spec.k} of {spec.k_full}): a rank's channels "
                "fall in groups of unequal size; marlin_wna16 / gptq_wna16 take it"
            )
        if reason := act_dtype_reason(spec.act_dtype, self.name, target):
            return False, reason
        group = group_of(spec)
        if spec.k % group or group % MIN_BLOCK_K:
            return False, (
                f"K per rank = {spec.k} and group size {group} must be multiples of each other and of "
                f"{MIN_BLOCK_K} (tile_wna16's K blocks lie inside one group)"
            )
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k, act, groups = spec.n, spec.k, spec.torch_act_dtype, spec.scale_groups
        out = {
            "qweight": StoredTensor((n, k * stored_bits(spec.bits) // 32), torch.int32),
            "scales": StoredTensor((groups, n), torch.float32 if spec.codebook else act),
        }
        if spec.codebook:
            out["codebook"] = StoredTensor((1 << spec.bits,), torch.float32)
        elif spec.float_zeros:
            out["mins"] = StoredTensor((groups, n), act)
        elif not spec.symmetric:
            out["zeros"] = StoredTensor((groups, n), torch.uint8)
        if spec.act_order:
            out["perm"] = StoredTensor((k,), torch.int32)
        return with_bias(out, spec, act)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, IntWeight, spec, group_map=True)
        ok, reason = self.supports(spec, target)
        if not ok:
            raise LayoutError(f"{spec.name}: {reason}")
        if (weight.mins is not None) != spec.float_zeros:
            raise LayoutError(
                f"{spec.name}: weight has {'a' if weight.mins is not None else 'no'} float minimum, "
                f"spec says float_zeros={spec.float_zeros}"
            )
        act = spec.torch_act_dtype
        codes = weight.codes
        out: dict[str, torch.Tensor] = {}
        if spec.act_order:
            perm = group_sorted_channels(weight.group_index(), group_of(spec), spec.name)
            codes = codes[:, perm]
            out["perm"] = perm.to(torch.int32)  # (K,)
        out |= {
            "qweight": pack_cols(
                to_stored_codes(codes, spec.bits, spec.midpoint_zero), stored_bits(spec.bits)
            ),  # (N, K // pf) int32
            "scales": weight.scales.to(torch.float32 if spec.codebook else act).contiguous(),  # (G, N)
        }
        if spec.codebook:
            if weight.codebook is None:
                raise LayoutError(
                    f"{spec.name}: spec names value table {spec.codebook!r}, the weight has none"
                )
            out["codebook"] = weight.codebook.float().contiguous()  # (2**bits,)
        if weight.zeros is not None:
            out["zeros"] = weight.zeros.to(torch.uint8).contiguous()  # (G, N)
        if weight.mins is not None:
            out["mins"] = weight.mins.to(act).contiguous()  # (G, N)
        if weight.bias is not None:
            out["bias"] = weight.bias.to(act).contiguous()  # (N,)
        return out

    def stored_int_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> IntWeight:
        stored = unpack_cols(tensors["qweight"].cpu(), stored_bits(spec.bits), spec.k)
        codes = from_stored_codes(stored, spec.bits, spec.midpoint_zero)  # (N, K)
        zeros = tensors["zeros"].cpu() if "zeros" in tensors else None
        mins = tensors["mins"].cpu() if "mins" in tensors else None
        g_idx = None
        if "perm" in tensors:  # back to the checkpoint's channel order
            perm = tensors["perm"].cpu().long()
            codes = torch.empty_like(codes).index_copy_(1, perm, codes)
            g_idx = torch.empty(spec.k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(spec.k) // group_of(spec)).to(torch.int32)
        codebook = tensors["codebook"].cpu() if "codebook" in tensors else None
        return IntWeight(
            codes,
            tensors["scales"].cpu(),
            spec.bits,
            spec.group_size,
            zeros,
            g_idx,
            mins=mins,
            codebook=codebook,
        )

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return tile_wna16_gemm(x, tensors, spec)

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The tensors, the offset kind and one launch config per M resolved once per layer."""
        args = _operands(tensors)
        reference = self.reference
        config = bound_configs(TileWNA16Kernel.name, spec.n, spec.k, lambda cfg: _fitted(cfg, spec))

        def run(x: torch.Tensor) -> torch.Tensor:
            if not runs_triton(x):
                return reference(x, tensors, spec)
            return _launch(x, args, tensors, spec, config(x.numel() // spec.k, x.device))

        return run


def _operands(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(scales, the offset tensor or a placeholder, OFFSET kind)."""
    scales = tensors["scales"]
    if "codebook" in tensors:
        return scales, tensors["codebook"], CODEBOOK
    if "mins" in tensors:
        return scales, tensors["mins"], FLOAT_MINS
    if "zeros" in tensors:
        return scales, tensors["zeros"], INT_ZEROS
    return scales, scales, SYMMETRIC


def group_sorted_channels(group_index: torch.Tensor, group: int, name: str) -> torch.Tensor:
    """(K,) int64 input channels sorted by group (stable), checked to give every group `group`
    channels in a row, so that K block j // group of the sorted weight is group j."""
    perm = torch.argsort(group_index, stable=True)
    expected = torch.arange(group_index.numel()) // group
    if not torch.equal(group_index[perm], expected):
        raise LayoutError(
            f"{name}: the act-order g_idx does not give every group {group} channels; "
            "marlin_wna16 / gptq_wna16 take such layers"
        )
    return perm


def _fitted(cfg: GemmConfig, spec: LinearSpec) -> GemmConfig:
    """`cfg` with BLOCK_K dividing the group (each K block inside one group, at least MIN_BLOCK_K)."""
    fitted, per_block = fit_to_groups(cfg, group_of(spec), act_order=False)
    if not per_block:
        raise LayoutError(f"{spec.name}: no K block of >= {MIN_BLOCK_K} divides group {group_of(spec)}")
    return fitted


def tile_wna16_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias); x (..., K) bf16/fp16 -> (..., N) in x's dtype. `config`: a launch config
    to use instead of the table's (the sweep and the tests pass one)."""
    m = x.numel() // spec.k
    cfg = _fitted(config or tuned_config(TileWNA16Kernel.name, m, spec.n, spec.k, x.device), spec)
    return _launch(x, _operands(tensors), tensors, spec, cfg)


def _launch(
    x: torch.Tensor,
    operands: tuple[torch.Tensor, torch.Tensor, int],
    tensors: dict[str, torch.Tensor],
    spec: LinearSpec,
    cfg: GemmConfig,
) -> torch.Tensor:
    x2 = gemm_rows(x, spec.k, TileWNA16Kernel.name)
    perm = tensors.get("perm")
    x2 = x2.index_select(1, perm) if perm is not None else x2.contiguous()  # act-order: sorted K
    m = x2.shape[0]
    scales, offsets, kind = operands
    run = GemmLaunch.plan(x, m, spec.n, cfg, tensors)
    return run.launch(
        _kernel(),
        x2, tensors["qweight"], scales, offsets, run.bias_or(scales), run.y,
        m, spec.n, spec.k, group_of(spec),
        BITS=stored_bits(spec.bits), OFFSET=kind,
    )  # fmt: skip


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]

    def tile_wna16_kernel(
        X, QW, S, OFF, BIAS, Y,
        M, N, K, group_size,
        BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        PF: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // PF  # int32 words of one row in a K block
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        row_words = K // PF
        rows = QW + offs_n[:, None].to(tl.int64) * row_words  # (BLOCK_N, 1) row starts
        shifts = tl.arange(0, PF) * BITS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, _, _ = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)  # (BM, BK)
            offs_w = it * WORDS + tl.arange(0, WORDS)
            words = tl.load(rows + offs_w[None, :], mask=mask_n[:, None], other=0)  # (BN, WORDS)
            q = (words[:, :, None] >> shifts[None, None, :]) & MASK  # (BN, WORDS, PF)
            q = tl.reshape(q, (BLOCK_N, BLOCK_K))  # code k = word * PF + field
            g = (it * BLOCK_K) // group_size
            s = tl.load(S + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            xf = x.to(tl.float32)
            if OFFSET == 3:  # value table: w = codebook[q] * s, no offset
                v = tl.load(OFF + q)  # (BN, BK) fp32, 16 values: served from L1
                if BLOCK_M == 1:
                    acc += tl.sum(v * xf, axis=1)[None, :] * s[None, :]
                else:
                    w = v * s[:, None]
                    if not BF16_INTERP:
                        w = w.to(x.dtype)  # the dequantized weight in the act dtype, as bitsandbytes has it
                    acc += tl.dot(x, tl.trans(w))
            else:
                if OFFSET == 2:
                    o = tl.load(OFF + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                elif OFFSET == 1:
                    o = -tl.load(OFF + g * N + offs_n, mask=mask_n, other=0).to(tl.float32) * s
                else:
                    o = -(1 << (BITS - 1)) * s
                x_sum = tl.sum(xf, axis=1)  # (BM,)
                if BLOCK_M == 1:  # GEMV: one row, multiply and reduce
                    part = tl.sum(q.to(tl.float32) * xf, axis=1)[None, :]  # (1, BN)
                else:
                    w = q.to(tl.float32)
                    if not BF16_INTERP:
                        w = w.to(x.dtype)  # integers below 256: exact in bf16 / fp16
                    part = tl.dot(x, tl.trans(w))  # (BM, BN)
                acc += part * s[None, :] + x_sum[:, None] * o[None, :]

        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(tile_wna16_kernel)
