"""fp8_w8a16: FP8 e4m3 weights x fp16/bf16 activations (W8A16) on the plain layout, every GPU target.

The fallback after fp8_marlin for the shapes Marlin refuses (N % 64, K % 128, e.g. SmolLM2's K = 576)
and for block scales Marlin cannot group; on sm75 (no FP8 hardware, no bf16 tensor cores) the FP8 path
with fp16 activations. Needs no FP8 support in the GPU: e4m3 is decoded from its raw bits.
Stored tensors (per rank):
    weight        (N, K) float8_e4m3fn  the checkpoint's bytes, row-major (K-contiguous)
    weight_scale  tensor / channel: (N,) float32, one multiplier per output row (per-tensor scales
                  of fused shards expanded over each shard's rows: no requantization)
                  block: (ceil(N / bn), ceil(K / bk)) float32, as in the checkpoint
    bias          (N,) act dtype, optional
    w[n, k] = e4m3(weight[n, k]) * scale, exactly Fp8Weight.dequantize().
Runtime: the kernel decodes each e4m3 byte exactly into fp32 (normals by rebasing the exponent bits,
subnormals as m * 2^-9), which is exact in fp16 and bf16 too, and runs the tensor-core dot on the
unscaled codes; per-row scales multiply the fp32 accumulator once at the end, block scales multiply
each K block's partial dot (BLOCK_K divides bk) before it is accumulated.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import Fp8Weight, LinearKernel, LinearSpec, SourceWeight, StoredTensor, Target, with_bias
from kernels.errors import LayoutError
from kernels.fp8_tiles import fp8_tiles
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles
from kernels.jit import act_dtype_reason, jit, runs_triton, triton_builder
from kernels.launch import GemmConfig, default_config, largest_block_dividing
from kernels.targets import GPU_TARGETS

MIN_BLOCK_K = 16  # the smallest K tile tl.dot takes; block widths bk must be multiples of it


class Fp8W8A16Kernel(LinearKernel):
    name: ClassVar[str] = "fp8_w8a16"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"fp8"})
    targets: ClassVar[frozenset[Target]] = GPU_TARGETS
    elsewhere: ClassVar[str] = "the cpu target uses cpu_fp8"
    description: ClassVar[str] = "FP8 e4m3 weight-only (W8A16) on the plain layout, any N/K, Triton"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if reason := act_dtype_reason(spec.act_dtype, self.name, target):
            return False, reason
        if spec.fp8_strategy == "block":
            if spec.block_size is None:
                return False, "block-scaled FP8 layer without block_size in its spec"
            bn, bk = spec.block_size
            if bn < 1 or bk % MIN_BLOCK_K:
                return False, (
                    f"FP8 block size {(bn, bk)}: fp8_w8a16 needs the block width bk to be a multiple of "
                    f"{MIN_BLOCK_K} (a K tile must divide it); serve the layer dense"
                )
        elif spec.fp8_strategy not in ("tensor", "channel"):
            return False, f"unknown FP8 strategy {spec.fp8_strategy!r}; expected tensor, channel or block"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k = spec.n, spec.k
        if spec.fp8_strategy == "block" and spec.block_size is not None:
            bn, bk = spec.block_size
            scale_shape: tuple[int, ...] = (-(-n // bn), -(-k // bk))
        else:
            scale_shape = (n,)
        out = {
            "weight": StoredTensor((n, k), torch.float8_e4m3fn),
            "weight_scale": StoredTensor(scale_shape, torch.float32),
        }
        return with_bias(out, spec, spec.torch_act_dtype)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, Fp8Weight, spec)
        out = {"weight": weight.weight.contiguous(), "weight_scale": _stored_scale(weight, spec)}
        if weight.bias is not None:
            out["bias"] = weight.bias.to(spec.torch_act_dtype).contiguous()  # (N,)
        return out

    def dequantize(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        w = tensors["weight"].cpu().float()  # (N, K)
        s = tensors["weight_scale"].cpu().float()
        if spec.fp8_strategy == "block":
            assert spec.block_size is not None
            bn, bk = spec.block_size
            full = s.repeat_interleave(bn, 0)[: spec.n].repeat_interleave(bk, 1)[:, : spec.k]
        else:
            full = s.reshape(spec.n, 1).expand(spec.n, spec.k)
        return (w * full).to(tensors["weight"].device)  # (N, K) fp32

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return fp8_w8a16_gemm(x, tensors, spec)


def _stored_scale(weight: Fp8Weight, spec: LinearSpec) -> torch.Tensor:
    """(N,) float32 for tensor / channel scales, the checkpoint's (ceil(N/bn), ceil(K/bk)) for blocks."""
    n, k = spec.n, spec.k
    s = weight.scale.float()
    if weight.strategy != spec.fp8_strategy:
        raise LayoutError(
            f"{spec.name}: weight has {weight.strategy!r} scales, spec says {spec.fp8_strategy!r}"
        )
    if weight.strategy == "tensor":
        # one scale covers every row (online FP8 quantizes a fused layer whole); else one per shard
        sizes = weight.shard_sizes or ((n,) if s.numel() == 1 else tuple(sh.size for sh in spec.shards))
        if len(sizes) != s.numel() or sum(sizes) != n:
            raise LayoutError(f"{spec.name}: {s.numel()} per-tensor scales for shards {sizes} (N={n})")
        return torch.repeat_interleave(s.reshape(-1), torch.tensor(sizes)).contiguous()
    if weight.strategy == "channel":
        if s.numel() != n:
            raise LayoutError(f"{spec.name}: {s.numel()} per-channel scales for N={n} rows")
        return s.reshape(n).contiguous()
    if spec.block_size is None or weight.block_size is None or tuple(weight.block_size) != spec.block_size:
        raise LayoutError(
            f"{spec.name}: block size {weight.block_size} does not match spec {spec.block_size}"
        )
    bn, bk = spec.block_size
    want = (-(-n // bn), -(-k // bk))
    if tuple(s.shape) != want:
        raise LayoutError(
            f"{spec.name}: block scales are {tuple(s.shape)}, expected {want} "
            f"for N={n}, K={k}, block {(bn, bk)}"
        )
    return s.contiguous()


def fit_to_fp8_blocks(cfg: GemmConfig, spec: LinearSpec) -> tuple[GemmConfig, bool, tuple[int, int]]:
    """(config, block scales?, (bn, bk)): with block scales BLOCK_K shrinks to divide the block width
    bk, so each K tile reads one scale column; per-row scales read as one (1, K) block."""
    block = spec.fp8_strategy == "block"
    bn, bk = spec.block_size if block and spec.block_size else (1, spec.k)
    if block:
        cfg = replace(cfg, block_k=largest_block_dividing(bk, cfg.block_k))
        if bk % cfg.block_k:
            raise LayoutError(f"{spec.name}: no K tile divides the FP8 block width {bk}")
    return cfg, block, (bn, bk)


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    e4m3_gemm = fp8_tiles()[1]

    def fp8_w8a16_kernel(
        X, W, S, BIAS, Y,
        M, N, K, block_n, block_k, k_blocks,
        BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        acc = e4m3_gemm(
            X, W, S, offs_m, mask_m, offs_n, mask_n, k_begin, k_end, K, block_n, block_k, k_blocks,
            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_SCALES, BF16_INTERP,
        )  # fmt: skip
        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(fp8_w8a16_kernel)


def fp8_w8a16_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias) reading the e4m3 bytes in place; x (..., K) bf16/fp16."""
    x2 = gemm_rows(x, spec.k, "fp8_w8a16").contiguous()
    m, n, k = x2.shape[0], spec.n, spec.k
    cfg, block, (bn, bk) = fit_to_fp8_blocks(config or default_config(m, n, k, x.device), spec)
    scale = tensors["weight_scale"]
    run = GemmLaunch.plan(x, m, n, cfg, tensors)
    return run.launch(
        _kernel(),
        x2, tensors["weight"].view(torch.uint8), scale, run.bias_or(scale), run.y,
        m, n, k, bn, bk, -(-k // bk),
        BLOCK_SCALES=block,
    )  # fmt: skip
