"""GEMM building blocks shared by the Triton kernels: the launch around a kernel call (`GemmLaunch`)
and the `@triton.jit` pieces every kernel body is made of (`gemm_tiles`, `operand_tiles`,
`grouped_dot_tile`).

Kernels step over K in BLOCK_K tiles; a program of a plain GEMM owns one (BLOCK_M, BLOCK_N) output
tile (grid axis 0) of one K split (grid axis 1); a grouped MoE GEMM owns one expert block
(kernels/moe/fused.py) and reads its activation rows through the block's token slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kernels.jit import bf16_interpreter, check_act_dtype, import_triton, jit, triton_builder
from kernels.launch import GemmConfig, launch_options


def gemm_output(m: int, n: int, x: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """The kernel's output buffer: act dtype, or a zeroed fp32 buffer that K splits atomically add into."""
    if cfg.split_k > 1:
        return torch.zeros(m, n, device=x.device, dtype=torch.float32)
    return torch.empty(m, n, device=x.device, dtype=x.dtype)


def finish_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cast a split-K fp32 buffer back to the act dtype (a no-op otherwise)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)


@dataclass
class GemmLaunch:
    """What every GEMM wrapper here does around its own kernel call: the output buffer, the grid
    over (M, N) tiles and K splits, the tile constexprs and launch options, and the final cast."""

    x: torch.Tensor  # the caller's activations (..., K)
    n: int
    cfg: GemmConfig
    y: torch.Tensor  # (M, N) output buffer (fp32 under split-K)
    grid: tuple[int, int]
    bias: torch.Tensor | None

    @classmethod
    def plan(
        cls, x: torch.Tensor, m: int, n: int, cfg: GemmConfig, tensors: dict[str, torch.Tensor]
    ) -> GemmLaunch:
        triton, _ = import_triton()
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
        return cls(x, n, cfg, gemm_output(m, n, x, cfg), grid, tensors.get("bias"))

    def bias_or(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The BIAS pointer: the layer's bias, or any tensor when it has none (HAS_BIAS is off)."""
        return placeholder if self.bias is None else self.bias

    def meta(self) -> dict[str, Any]:
        """Keyword arguments every GEMM kernel takes: tile sizes, split-K, bias, the interpreter flag."""
        c = self.cfg
        return {
            "HAS_BIAS": self.bias is not None,
            "BLOCK_M": c.block_m,
            "BLOCK_N": c.block_n,
            "BLOCK_K": c.block_k,
            "SPLIT_K": c.split_k,
            "BF16_INTERP": bf16_interpreter(self.x),
            **launch_options(self.x, c),
        }

    def launch(self, kernel: Any, *args: Any, **constexprs: Any) -> torch.Tensor:
        """Run `kernel` over the grid (`meta()` joins the constexprs); (..., N) in the activations' dtype.
        Over no rows (M = 0) nothing is launched."""
        if self.grid[0]:
            kernel[self.grid](*args, **constexprs, **self.meta())
        return finish_output(self.y, self.x).reshape(*self.x.shape[:-1], self.n)


def gemm_rows(x: torch.Tensor, k: int, kernel: str) -> torch.Tensor:
    """The activations as (M, K) rows, after checking their dtype for `kernel`."""
    check_act_dtype(x, kernel)
    return x.reshape(-1, k)


@triton_builder
def gemm_tiles(tl: ModuleType) -> tuple[Any, Any]:
    """(gemm_program, store_tile), the `@triton.jit` frame of a plain GEMM kernel:
    `gemm_program`: this program's output rows / columns and their masks (grid axis 0 = M x N tiles),
    its K split (grid axis 1) and that split's K iterations [k_begin, k_end);
    `store_tile`: add the bias once (first K split), then store the fp32 tile in Y's dtype, or
    atomically add it under split-K."""

    def gemm_program(
        M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr
    ):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        grid_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_end = tl.minimum(tl.cdiv(K, BLOCK_K), (pid_k + 1) * per_split)
        return offs_m, offs_n, offs_m < M, offs_n < N, pid_k, pid_k * per_split, k_end

    def store_tile(
        acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        y_ptrs = Y + offs_m[:, None] * N + offs_n[None, :]
        mask_mn = mask_m[:, None] & mask_n[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
        if SPLIT_K == 1:
            if BF16_INTERP:  # round to nearest even by hand: the interpreter's bf16 cast truncates
                bits = acc.to(tl.int32, bitcast=True)
                acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_mn)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask_mn)

    return jit(gemm_program), jit(store_tile)


@triton_builder
def operand_tiles(tl: ModuleType) -> tuple[Any, Any]:
    """(x_tile, kmajor_tile), `@triton.jit` loads of one K step:
    `x_tile`: K iteration `it` of the activations, rows `rows` of the row-major (M, K) X, with its
    K offsets and mask; fp32 under BF16_INTERP;
    `kmajor_tile`: the (BLOCK_K, BLOCK_N) view of the K-major (N, K) weight W at those K offsets."""

    def x_tile(X, rows, mask_m, it, K, BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr):
        offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_mk = mask_m[:, None] & mask_k[None, :]
        x = tl.load(X + rows[:, None] * K + offs_k[None, :], mask=mask_mk, other=0.0)
        if BF16_INTERP:
            x = x.to(tl.float32)
        return x, offs_k, mask_k

    def kmajor_tile(W, offs_n, mask_n, offs_k, mask_k, K):
        mask_kn = mask_k[:, None] & mask_n[None, :]
        return tl.load(W + offs_n[None, :].to(tl.int64) * K + offs_k[:, None], mask=mask_kn, other=0.0)

    return jit(x_tile), jit(kmajor_tile)


@triton_builder
def grouped_dot_tile(tl: ModuleType) -> Any:
    """`@triton.jit` grouped_dot: acc + x @ dequant(q) for one K step of integer codes q (BLOCK_K,
    BLOCK_N): one scale row per K block (PER_BLOCK_SCALE, applied to the dot's result) or scales
    gathered per element (act-order, odd groups); zero points packed along N (word zp_col, field
    zp_shift, rows of zp_stride words) or 2 ** (BITS - 1)."""

    def grouped_dot(
        acc, x, q, S, ZP, GIDX, it, offs_k, mask_k, mask_n, s_col, zp_col, zp_shift, zp_stride, N, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr,
        BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        MASK: tl.constexpr = (1 << BITS) - 1
        if PER_BLOCK_SCALE:
            g = (it * BLOCK_K) // group_size
            s = tl.load(S + g * N + s_col, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_ZP:
                zw = tl.load(ZP + g * zp_stride + zp_col, mask=mask_n, other=0)
                w = (q - ((zw >> zp_shift) & MASK)[None, :]).to(tl.float32)
            else:
                w = (q - (1 << (BITS - 1))).to(tl.float32)
            if not BF16_INTERP:
                w = w.to(x.dtype)  # integers below 256: exact in bf16/fp16
            acc += tl.dot(x, w) * s[None, :]
        else:
            mask_kn = mask_k[:, None] & mask_n[None, :]
            if ACT_ORDER:
                g = tl.load(GIDX + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // group_size
            s = tl.load(S + g[:, None] * N + s_col[None, :], mask=mask_kn, other=0.0).to(tl.float32)
            if HAS_ZP:
                zw = tl.load(ZP + g[:, None] * zp_stride + zp_col[None, :], mask=mask_kn, other=0)
                w = (q - ((zw >> zp_shift[None, :]) & MASK)).to(tl.float32) * s
            else:
                w = (q - (1 << (BITS - 1))).to(tl.float32) * s
            if not BF16_INTERP:
                w = w.to(x.dtype)
            acc += tl.dot(x, w)
        return acc

    return jit(grouped_dot)
