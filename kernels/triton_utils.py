"""Small helpers shared by the Triton kernels: lazy import, where a kernel may run, launch configs.

Triton is imported only inside functions, so importing a kernel module never needs Triton or a GPU.
A kernel's `apply` runs its Triton kernel on CUDA tensors; on CPU tensors it runs the same kernel
through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before Triton was first imported,
and otherwise falls back to the kernel's pure-torch reference twin.

The interpreter's fp32/fp16 -> e4m3 downcast rounds wrongly (docs/formats.md §17.1); kernels that cast to
fp8 inside Triton take an ``INTERPRET`` constexpr and round onto the e4m3 grid first (a no-op on GPU).
The interpreter also mishandles bfloat16 (measured here): ``tl.dot`` on bf16 operands returns garbage
(it reads the bits as integers), int -> bf16 casts give NaN, and fp32 -> bf16 casts truncate instead
of rounding to nearest even. Kernels therefore take a ``BF16_INTERP`` constexpr (`bf16_interpreter`):
under it the dot runs on fp32 operands and the fp32 result is rounded to bf16 (RNE) on its bits
before the store. On a GPU the flag is off and the dot runs on bf16 tensor cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from types import ModuleType
from typing import Any, Literal

import torch

from kernels.errors import UnsupportedError
from kernels.moe_base import W2, W13, MoESpec, swiglu

ACT_DTYPES = ("bfloat16", "float16")


def interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def import_triton() -> tuple[ModuleType, ModuleType]:
    """(triton, triton.language), or an actionable error when Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - triton is a dev dependency
        raise UnsupportedError(
            "the GPU kernels need Triton: pip install 'kiln[triton]' (triton==3.7.1)"
        ) from exc
    return triton, tl


def runs_triton(x: torch.Tensor) -> bool:
    """Whether `apply` should launch the Triton kernel for this input (else: the torch reference)."""
    if x.is_cuda:
        return True
    return x.device.type == "cpu" and interpreter_enabled() and triton_installed()


def bf16_interpreter(x: torch.Tensor) -> bool:
    """bfloat16 activations under the interpreter: enable the BF16_INTERP workarounds (module docstring)."""
    return interpreter_enabled() and x.dtype == torch.bfloat16


def check_act_dtype(x: torch.Tensor, kernel: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedError(f"{kernel} takes bfloat16 or float16 activations, got {x.dtype}")


def act_dtype_reason(act_dtype: str, kernel: str) -> str:
    """'' when the activation dtype is one the Triton kernels take, else the refusal reason."""
    if act_dtype in ACT_DTYPES:
        return ""
    return f"{kernel} runs bfloat16 or float16 activations, not {act_dtype}; use the dense or a cpu kernel"


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of a dequant-GEMM (no autotuning: fixed per M bucket)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_config(
    m: int, n: int, k: int, device: torch.device, *, kind: Literal["dequant", "fp8"] = "dequant"
) -> GemmConfig:
    """Block sizes by M bucket (no autotuning, `cuda_block_config`); split-K fills the GPU when
    M and N leave fewer than two tiles per SM.

    "dequant" kernels gather an int32 word per weight element, so their tiles cost 4 bytes per
    element per pipeline stage: the sizes keep 3 stages under the 99 KB of shared memory of
    sm86/sm89 (checked by compiling for sm80/sm90: bench/gpu_check.py --compile-only). Kernels
    that gather scales per element too (act-order, odd groups) drop to 2 stages (`fit_to_groups`).
    "fp8" (fp8_w8a8) loads 1-byte tiles. On the CPU interpreter wide tiles and no split-K are cheapest.
    """
    if device.type != "cuda" or interpreter_enabled():
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        return GemmConfig(block_m=block_m, block_n=128, block_k=128, split_k=1)
    cfg = cuda_block_config(m, kind)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split_k = 1
    while tiles * split_k < 2 * sms and k // (split_k * 2) >= 4 * cfg.block_k and split_k < 16:
        split_k *= 2
    return replace(cfg, split_k=split_k)


def cuda_block_config(m: int, kind: Literal["dequant", "fp8"] = "dequant") -> GemmConfig:
    """Tile sizes, warps and stages by M bucket on CUDA (split-K is decided by `default_config`)."""
    if kind == "fp8":
        if m <= 16:
            return GemmConfig(16, 64, 128, num_warps=4, num_stages=4)
        if m <= 64:
            return GemmConfig(64, 128, 128, num_warps=8, num_stages=4)
        return GemmConfig(128, 128, 64, num_warps=8, num_stages=4)
    if m <= 16:
        return GemmConfig(16, 64, 128, num_warps=4, num_stages=3)
    if m <= 32:
        return GemmConfig(32, 64, 64, num_warps=4, num_stages=3)
    if m <= 64:
        return GemmConfig(64, 128, 64, num_warps=8, num_stages=3)
    return GemmConfig(128, 128, 32, num_warps=8, num_stages=3)


def fit_to_groups(cfg: GemmConfig, group_size: int, *, act_order: bool) -> tuple[GemmConfig, bool]:
    """(config, per_block_scale): shrink BLOCK_K to divide the group so each K block reads one scale
    row (applied to the dot's result); otherwise (act-order, odd groups) scales are gathered per
    element, which doubles the bytes per stage, so the pipeline is capped at 2 stages."""
    if not act_order:
        cfg = replace(cfg, block_k=largest_block_dividing(group_size, cfg.block_k))
        if group_size % cfg.block_k == 0:
            return cfg, True
    return replace(cfg, num_stages=min(cfg.num_stages, 2)), False


def launch_options(x: torch.Tensor, cfg: GemmConfig) -> dict[str, int]:
    """num_warps / num_stages for a CUDA launch (the interpreter takes none)."""
    if x.is_cuda and not interpreter_enabled():
        return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return {}


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

    @classmethod
    def plan(cls, x: torch.Tensor, m: int, n: int, cfg: GemmConfig) -> GemmLaunch:
        triton, _ = import_triton()
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
        return cls(x, n, cfg, gemm_output(m, n, x, cfg), grid)

    def meta(self) -> dict[str, Any]:
        """Keyword arguments every GEMM kernel takes: tile sizes, split-K, the interpreter flag."""
        c = self.cfg
        return {
            "BLOCK_M": c.block_m,
            "BLOCK_N": c.block_n,
            "BLOCK_K": c.block_k,
            "SPLIT_K": c.split_k,
            "BF16_INTERP": bf16_interpreter(self.x),
            **launch_options(self.x, c),
        }

    def result(self) -> torch.Tensor:
        """(..., N) in the activations' dtype."""
        return finish_output(self.y, self.x).reshape(*self.x.shape[:-1], self.n)


def gemm_rows(x: torch.Tensor, k: int, kernel: str) -> torch.Tensor:
    """The activations as (M, K) rows, after checking their dtype for `kernel`."""
    check_act_dtype(x, kernel)
    return x.reshape(-1, k)


def empty_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """The (..., N) result of a GEMM over no rows."""
    return x.new_empty(*x.shape[:-1], n)


def with_epilogue(module_globals: dict[str, Any]) -> tuple[ModuleType, ModuleType]:
    """`import_triton()`, with the shared `@triton.jit` GEMM helpers (`tile_offsets`, `k_range`,
    `store_tile`) bound in a kernel module's globals (not a closure: Triton's interpreter resolves
    callees in the kernel's globals)."""
    module_globals.update(gemm_helpers())
    return import_triton()


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def largest_block_dividing(group_size: int, block_k: int) -> int:
    """The largest power-of-two block (>= 16) <= block_k that divides group_size, or block_k if none."""
    b = block_k
    while b >= 16:
        if group_size % b == 0:
            return b
        b //= 2
    return block_k


@cache
def gemm_helpers() -> dict[str, Any]:
    """The `@triton.jit` helpers every GEMM kernel here shares:
    `tile_offsets`: this program's output rows / columns and their masks (grid axis 0 = M x N tiles);
    `k_range`: the K iterations of this program's split (grid axis 1 = K splits);
    `store_tile`: add the bias once (first K split), then store the fp32 tile in Y's dtype, or
    atomically add it under split-K."""
    global tl  # Triton's interpreter looks `tl` up in a called helper's module globals
    triton, tl = import_triton()

    @triton.jit
    def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_m, offs_n, offs_m < M, offs_n < N

    @triton.jit
    def k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_k = tl.program_id(1)
        k_iters = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_iters, SPLIT_K)
        return pid_k * per_split, tl.minimum(k_iters, (pid_k + 1) * per_split)

    @triton.jit
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

    return {"tile_offsets": tile_offsets, "k_range": k_range, "store_tile": store_tile}


# ---------------------------------------------------------------------------------------------
# Mixture-of-experts: route sorting and the fused expert MLP around two grouped GEMM launches
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoERoutes:
    """Token slots sorted by local expert and padded per expert to BLOCK_M (vLLM's
    moe_align_block_size). A slot is one (token, choice) pair, numbered t * top_k + j.

    sorted_ids    (blocks * BLOCK_M,) int32  slot of each row of the grouped GEMM; `num_slots` pads
    block_experts (blocks,) int32            local expert of each BLOCK_M block, -1: an empty block
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    block_m: int
    num_slots: int  # tokens * top_k; also the padding id (one past the last slot)
    top_k: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    first_expert: int,
    num_experts: int,
    *,
    exact_size: bool | None = None,
) -> MoERoutes:
    """Group the (T, top_k) routes by local expert (experts [first_expert, first_expert + num_experts)
    of this rank; other ids are dropped), each expert's slots in token order and padded to a whole
    number of BLOCK_M blocks. On CUDA (exact_size None or False) there is no host sync: the arrays are
    sized for the worst case (min(slots + E (BLOCK_M - 1), slots BLOCK_M) rows) and the blocks past
    the last expert are -1; on CPU (or exact_size=True) they are cut to the exact size."""
    tokens, top_k = topk_ids.shape
    slots = tokens * top_k
    dev = topk_ids.device
    local = topk_ids.reshape(-1).to(torch.int64) - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # num: not ours
    sorted_e, order = torch.sort(local, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first_sorted = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    if exact_size is None:
        exact_size = dev.type != "cuda"
    if not exact_size:
        rows = min(slots + num_experts * (block_m - 1), slots * block_m)
        rows = -(-rows // block_m) * block_m
    else:
        rows = int(ends[-1]) if num_experts else 0
    e = sorted_e.clamp(max=max(num_experts - 1, 0))
    dest = starts[e] + torch.arange(slots, device=dev) - first_sorted[e]
    dest = torch.where(sorted_e < num_experts, dest, rows)  # other ranks' slots: a discarded cell
    sorted_ids = torch.full((rows + 1,), slots, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return MoERoutes(sorted_ids[:rows], block_experts, block_m, slots, top_k)


def moe_config(rows_per_expert: float, device: torch.device, kind: Literal["dequant", "fp8"]) -> GemmConfig:
    """Tiles of a grouped MoE GEMM, by the average rows (token slots) per local expert: the M
    bucket of `cuda_block_config` capped at 64 (each expert's rows are padded to BLOCK_M); no
    split-K. On the CPU interpreter 16-row blocks and wide N / K tiles."""
    m = max(1, min(int(rows_per_expert + 0.5), 64))
    if device.type != "cuda" or interpreter_enabled():
        return GemmConfig(block_m=16 if m <= 16 else 32 if m <= 32 else 64, block_n=128, block_k=128)
    return cuda_block_config(m, kind)


# launch(part, a, routes, y, routed_weights, cfg): one grouped GEMM of part "w13" or "w2" over `routes`,
# rows of `a` read per slot (w13: token = slot // top_k; w2: the slot's own row), written to y[slot].
MoEGemmLaunch = Callable[[str, torch.Tensor, MoERoutes, torch.Tensor, torch.Tensor | None, GemmConfig], None]


def fused_moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    spec: MoESpec,
    launch: MoEGemmLaunch,
    kind: Literal["dequant", "fp8"],
    kernel: str,
) -> torch.Tensor:
    """The fused-MoE schedule (vLLM's fused_experts): sort the routes by expert, one grouped GEMM
    for every expert's gate|up, silu(gate) * up in fp32 (rounded to the act dtype), one grouped GEMM
    for every expert's down projection that multiplies each row by its routing weight, then the sum
    over the top-k choices in fp32."""
    check_act_dtype(x, kernel)
    tokens, top_k = topk_ids.shape
    hidden, inter = spec.hidden, spec.intermediate
    x = x.reshape(tokens, hidden).contiguous()
    cfg = moe_config(tokens * top_k / spec.num_experts, x.device, kind)
    routes = moe_align_block_size(topk_ids, cfg.block_m, spec.first_expert, spec.num_experts)
    if tokens == 0 or routes.num_blocks == 0:
        return x.new_zeros(tokens, hidden)
    # Rows of slots not routed here (other ranks' experts) are never written by the kernels: gate|up
    # rows must stay finite (fp8_moe_w8a8 quantizes every row) and down rows must add nothing.
    alloc = x.new_empty if spec.num_experts == spec.total_experts else x.new_zeros
    gate_up = alloc(routes.num_slots, 2 * inter)
    launch(W13, x, routes, gate_up, None, cfg)
    h = swiglu(gate_up).to(x.dtype)
    down = x.new_zeros(routes.num_slots, hidden)  # a memset: ids out of range add nothing either
    launch(W2, h, routes, down, topk_weights.reshape(-1).float().contiguous(), cfg)
    return down.view(tokens, top_k, hidden).float().sum(1).to(x.dtype)


def moe_grid(routes: MoERoutes, n: int, block_n: int) -> tuple[int, int]:
    """(BLOCK_M blocks, N tiles): consecutive programs share an N tile (the same expert's weights)."""
    return routes.num_blocks, -(-n // block_n)


@cache
def moe_helpers() -> dict[str, Any]:
    """`@triton.jit` helpers of the grouped MoE GEMMs:
    `moe_tile`: this program's block (grid axis 0) and N tile (axis 1): its local expert (-1: an
    empty block), the slots of its BLOCK_M rows with their mask, the output columns with theirs;
    `e4m3_to_f32`: exact e4m3 decode of int32 bit patterns (normals rebase the exponent bias
    7 -> 127, subnormals m * 2^-9), for GPUs without FP8 conversion instructions."""
    global tl
    triton, tl = import_triton()

    @triton.jit
    def moe_tile(SORTED, BLOCK_EXPERT, num_slots, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(BLOCK_EXPERT + pid_m)
        slots = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return expert, slots, slots < num_slots, offs_n, offs_n < N

    @triton.jit
    def e4m3_to_f32(b):
        em = b & 0x7F
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        mag = tl.where(em < 8, (em & 7).to(tl.float32) * 0.001953125, normal)
        return tl.where((b & 0x80) != 0, -mag, mag)

    return {"moe_tile": moe_tile, "e4m3_to_f32": e4m3_to_f32}


@cache
def marlin_helpers() -> dict[str, Any]:
    """`@triton.jit` pieces of a dequant-GEMM reading vLLM's Marlin layout in place
    (kernels/marlin_wna16.py documents the index map; docs/formats.md §4):
    `marlin_n_terms`: the column-only terms of a BLOCK_N tile (word column and field shift of the
    weight, column of its scale, word and shift of its 4-bit zero point);
    `marlin_dot`: acc + x @ dequant(tile) for one BLOCK_K step, with one scale row per K block
    (PER_BLOCK_SCALE, applied to the dot's result) or gathered per element (act-order, odd groups).
    QW / S / ZP / GIDX point at one layer's (one expert's) tensors."""
    global tl
    triton, tl = import_triton()

    @triton.jit
    def marlin_n_terms(offs_n, BITS: tl.constexpr, GROUPED_SCALES: tl.constexpr):
        if BITS == 4:
            col_n = 128 * (offs_n // 64) + 16 * (offs_n % 8) + (offs_n % 64) // 16
            shift_n = 8 * ((offs_n % 16) // 8)
        else:
            col_n = 256 * (offs_n // 64) + 32 * (offs_n % 8) + 2 * ((offs_n % 64) // 16) + (offs_n % 16) // 8
            shift_n = 0 * offs_n
        if GROUPED_SCALES:
            s_col = 64 * (offs_n // 64) + 8 * (offs_n % 8) + (offs_n % 64) // 8
        else:
            s_col = 32 * (offs_n // 32) + 8 * ((offs_n % 8) // 2) + 2 * ((offs_n % 32) // 8) + offs_n % 2
        zj = (offs_n % 64) // 8
        zp_col = 8 * (offs_n // 64) + offs_n % 8
        zp_shift = 4 * (zj // 2 + 4 * (zj % 2))
        return col_n, shift_n, s_col, zp_col, zp_shift

    @triton.jit
    def marlin_dot(
        acc, x, QW, S, ZP, GIDX, it, offs_k, mask_k, mask_n, col_n, shift_n, s_col, zp_col, zp_shift,
        N, group_size,
        BITS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr, PER_BLOCK_SCALE: tl.constexpr,
        BLOCK_K: tl.constexpr, BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        MASK: tl.constexpr = (1 << BITS) - 1
        ROW_WORDS = N * BITS // 2  # int32 words per 16-row k-tile
        mask_kn = mask_k[:, None] & mask_n[None, :]
        if BITS == 4:
            col_k = 4 * ((offs_k % 8) // 2)
            shift_k = 4 * ((offs_k % 16) // 8 + 4 * (offs_k % 2))
        else:
            col_k = 8 * ((offs_k % 8) // 2)
            shift_k = 8 * ((offs_k % 16) // 8 + 2 * (offs_k % 2))
        addr = (offs_k // 16 * ROW_WORDS + col_k)[:, None] + col_n[None, :]
        words = tl.load(QW + addr, mask=mask_kn, other=0)
        q = (words >> (shift_k[:, None] + shift_n[None, :])) & MASK  # (BLOCK_K, BLOCK_N) codes
        if PER_BLOCK_SCALE:
            g = (it * BLOCK_K) // group_size
            s = tl.load(S + g * N + s_col, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_ZP:
                zw = tl.load(ZP + g * (N // 8) + zp_col, mask=mask_n, other=0)
                w = (q - ((zw >> zp_shift) & MASK)[None, :]).to(tl.float32)
            else:
                w = (q - (1 << (BITS - 1))).to(tl.float32)
            if not BF16_INTERP:
                w = w.to(x.dtype)  # integers below 256: exact in bf16/fp16
            acc += tl.dot(x, w) * s[None, :]
        else:
            if ACT_ORDER:
                g = tl.load(GIDX + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // group_size
            s = tl.load(S + g[:, None] * N + s_col[None, :], mask=mask_kn, other=0.0).to(tl.float32)
            if HAS_ZP:
                zw = tl.load(ZP + g[:, None] * (N // 8) + zp_col[None, :], mask=mask_kn, other=0)
                w = (q - ((zw >> zp_shift[None, :]) & MASK)).to(tl.float32) * s
            else:
                w = (q - (1 << (BITS - 1))).to(tl.float32) * s
            if not BF16_INTERP:
                w = w.to(x.dtype)
            acc += tl.dot(x, w)
        return acc

    return {"marlin_n_terms": marlin_n_terms, "marlin_dot": marlin_dot}


def with_helpers(module_globals: dict[str, Any], *helpers: dict[str, Any]) -> tuple[ModuleType, ModuleType]:
    """`with_epilogue`, plus more `@triton.jit` helper sets (`moe_helpers()`, `marlin_helpers()`)
    bound in the kernel module's globals."""
    for h in helpers:
        module_globals.update(h)
    return with_epilogue(module_globals)
