"""tile_fp4: NVFP4 / MXFP4 weight-only (W4A16) GEMV / GEMM on Kiln's own GPU layout (Triton), sm80+.

Written for `kiln serve` (conversions with `--gpu-layout kiln`). Each output row's E2M1 codes lie
contiguous along K, 8 per int32 word, so a program loads every word once and unpacks it with shifts
(marlin_fp4 gathers one word per element from the Marlin tiles). The block scales stay the bytes the
checkpoint holds, row beside row; NVFP4's global multiplier is kept per output row, so fused q/k/v or
gate/up shards with different globals need no requantization (Marlin holds one per layer).

Stored tensors (per rank; G = K // group, group 16 for nvfp4, 32 for mxfp4):
    qweight       (N, K // 8) int32  code k of row n in bits [4 (k % 8), 4 (k % 8) + 4) of word k // 8:
                                     the checkpoint's packed bytes (low nibble first) viewed as int32
    scales        (N, G)             nvfp4: float8_e4m3fn block scales; mxfp4: uint8 E8M0 exponents
    global_scale  (N,) float32       nvfp4 only: the global multiplier of each row's shard
    bias          (N,) act dtype     optional
    w[n, k] = E2M1(code) * scale[n, k // group] (* global_scale[n])

The kernel decodes codes and scale bytes by bit arithmetic into fp32 (no FP8 loads: sm80 / sm86 have
no FP8 conversions); E2M1 (2 significant bits) times an E4M3 scale (4 bits) is exact in bf16 and
fp16, so the tensor-core path rounds nothing before the fp32 accumulator, which the global multiplies
per column. M = 1 runs a GEMV program (fp32 multiply and reduce), larger M tensor-core tiles; split-K
by occupancy at decode shapes. Launch configs: kernels/launch_table.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any, ClassVar

import torch

from kernels.base import (
    DecodedLayoutKernel,
    Fp4Weight,
    LinearSpec,
    SourceWeight,
    StoredTensor,
    Target,
    with_bias,
)
from kernels.codecs.bitpack import pack_cols, unpack_cols
from kernels.errors import LayoutError
from kernels.fp4_tiles import fp4_gpu_reason, fp4_tiles
from kernels.gemm import GemmLaunch, gemm_rows, gemm_tiles, operand_tiles
from kernels.jit import jit, runs_triton, triton_builder
from kernels.launch import GemmConfig
from kernels.launch_table import bound_configs, tuned_config
from kernels.targets import gpu_targets

CODES_PER_WORD = 8


class TileFp4Kernel(DecodedLayoutKernel):
    name: ClassVar[str] = "tile_fp4"
    layout_version: ClassVar[int] = 1
    schemes: ClassVar[frozenset[str]] = frozenset({"fp4"})
    targets: ClassVar[frozenset[Target]] = gpu_targets(80)
    kiln_layout: ClassVar[bool] = True
    elsewhere: ClassVar[str] = "cpu uses cpu_fp4"
    description: ClassVar[str] = "NVFP4 / MXFP4 weight-only, Kiln row-contiguous layout, Triton GEMV / GEMM"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if reason := fp4_gpu_reason(spec, self.name, target):
            return False, reason
        if spec.k % spec.group_size:
            block = f"{spec.fp4_format} block ({spec.group_size})"
            return False, f"K per rank = {spec.k} is not a multiple of the {block}"
        return True, ""

    def stored_tensors(self, spec: LinearSpec, target: Target) -> dict[str, StoredTensor]:
        n, k = spec.n, spec.k
        nvfp4 = spec.fp4_format == "nvfp4"
        out = {
            "qweight": StoredTensor((n, k // CODES_PER_WORD), torch.int32),
            "scales": StoredTensor((n, k // spec.group_size), torch.float8_e4m3fn if nvfp4 else torch.uint8),
        }
        if nvfp4:
            out["global_scale"] = StoredTensor((n,), torch.float32)
        return with_bias(out, spec, spec.torch_act_dtype)

    def prepare(self, weight: SourceWeight, spec: LinearSpec, target: Target) -> dict[str, torch.Tensor]:
        weight = self.prepare_input(weight, Fp4Weight, spec)
        ok, reason = self.supports(spec, target)
        if not ok:
            raise LayoutError(f"{spec.name}: {reason}")
        if weight.fmt != spec.fp4_format:
            raise LayoutError(f"{spec.name}: a {weight.fmt} weight for a {spec.fp4_format} spec")
        if bool(torch.isnan(weight.scale_values()).any()):
            raise LayoutError(f"{spec.name}: NaN FP4 block scales (re-quantize the checkpoint)")
        out: dict[str, torch.Tensor] = {
            "qweight": pack_cols(weight.codes, 4),  # (N, K // 8) int32
            "scales": weight.scales.contiguous(),  # (N, G) e4m3 | uint8 E8M0
        }
        row_global = weight.row_global()
        if row_global is not None:
            out["global_scale"] = row_global.float().contiguous()  # (N,)
        if weight.bias is not None:
            out["bias"] = weight.bias.to(spec.torch_act_dtype).contiguous()  # (N,)
        return out

    def stored_weight(self, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> Fp4Weight:
        assert spec.fp4_format is not None
        codes = unpack_cols(tensors["qweight"].cpu(), 4, spec.k).to(torch.uint8)  # (N, K)
        scales = tensors["scales"].cpu()
        g = tensors.get("global_scale")
        if g is None:
            return Fp4Weight(codes, scales, spec.fp4_format)
        shards, sizes = torch.unique_consecutive(g.cpu().float(), return_counts=True)  # runs of one shard
        return Fp4Weight(codes, scales, spec.fp4_format, shards, tuple(int(s) for s in sizes))

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> torch.Tensor:
        if not runs_triton(x):
            return self.reference(x, tensors, spec)
        return tile_fp4_gemm(x, tensors, spec)

    def bind_apply(
        self, tensors: dict[str, torch.Tensor], spec: LinearSpec
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """One launch config per (M, device) resolved once per layer."""
        reference = self.reference
        config = bound_configs(TileFp4Kernel.name, spec.n, spec.k, lambda cfg: _fitted(cfg, spec))

        def run(x: torch.Tensor) -> torch.Tensor:
            if not runs_triton(x):
                return reference(x, tensors, spec)
            return _launch(x, tensors, spec, config(x.numel() // spec.k, x.device))

        return run


def _fitted(cfg: GemmConfig, spec: LinearSpec) -> GemmConfig:
    """`cfg` with BLOCK_K holding whole scale blocks (at least one group)."""
    return replace(cfg, block_k=max(cfg.block_k, spec.group_size))


def tile_fp4_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, config: GemmConfig | None = None
) -> torch.Tensor:
    """y = x @ W.T (+ bias); x (..., K) bf16/fp16 -> (..., N) in x's dtype. `config`: a launch config
    to use instead of the table's (the sweep and the tests pass one)."""
    m = x.numel() // spec.k
    cfg = config or tuned_config(TileFp4Kernel.name, m, spec.n, spec.k, x.device)
    return _launch(x, tensors, spec, _fitted(cfg, spec))


def _launch(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: LinearSpec, cfg: GemmConfig
) -> torch.Tensor:
    x2 = gemm_rows(x, spec.k, TileFp4Kernel.name).contiguous()
    m = x2.shape[0]
    scales = tensors["scales"].view(torch.uint8)
    nvfp4 = spec.fp4_format == "nvfp4"
    run = GemmLaunch.plan(x, m, spec.n, cfg, tensors)
    return run.launch(
        _kernel(),
        x2, tensors["qweight"], scales, tensors["global_scale"] if nvfp4 else scales,
        run.bias_or(scales), run.y,
        m, spec.n, spec.k,
        GROUP=spec.group_size, NVFP4=nvfp4,
    )  # fmt: skip


@triton_builder
def _kernel(tl: ModuleType) -> Any:
    gemm_program, store_tile = gemm_tiles()
    x_tile = operand_tiles()[0]
    e2m1_fp32, block_scale_fp32 = fp4_tiles()

    def tile_fp4_kernel(
        X, QW, S, GS, BIAS, Y,
        M, N, K,
        GROUP: tl.constexpr, NVFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BF16_INTERP: tl.constexpr,
    ):  # fmt: skip
        WORDS: tl.constexpr = BLOCK_K // 8  # int32 words of one row in a K block
        BLOCKS: tl.constexpr = BLOCK_K // GROUP  # scale blocks of one row in a K block
        offs_m, offs_n, mask_m, mask_n, pid_k, k_begin, k_end = gemm_program(
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K
        )
        row_words, row_blocks = K // 8, K // GROUP
        rows = QW + offs_n[:, None].to(tl.int64) * row_words  # (BLOCK_N, 1) row starts
        scale_rows = S + offs_n[:, None].to(tl.int64) * row_blocks
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(k_begin, k_end):
            x, _, _ = x_tile(X, offs_m, mask_m, it, K, BLOCK_K, BF16_INTERP)  # (BM, BK)
            offs_w = it * WORDS + tl.arange(0, WORDS)
            mask_w = mask_n[:, None] & (offs_w < row_words)[None, :]
            words = tl.load(rows + offs_w[None, :], mask=mask_w, other=0)  # (BN, WORDS)
            q = (words[:, :, None] >> shifts[None, None, :]) & 15  # (BN, WORDS, 8)
            v = e2m1_fp32(tl.reshape(q, (BLOCK_N, BLOCK_K)))  # code k = word * 8 + field
            offs_b = it * BLOCKS + tl.arange(0, BLOCKS)
            mask_b = mask_n[:, None] & (offs_b < row_blocks)[None, :]
            b = tl.load(scale_rows + offs_b[None, :], mask=mask_b, other=0).to(tl.int32)  # (BN, BLOCKS)
            s = block_scale_fp32(b, NVFP4)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCKS, GROUP)), (BLOCK_N, BLOCK_K))
            w = v * s  # (BN, BK) exact: at most 6 significant bits
            if BLOCK_M == 1:  # GEMV: one row, multiply and reduce
                part = tl.sum(w * x.to(tl.float32), axis=1)[None, :]  # (1, BN)
            else:
                if not BF16_INTERP:
                    w = w.to(x.dtype)
                part = tl.dot(x, tl.trans(w))  # (BM, BN)
            acc += part
        if NVFP4:
            acc = acc * tl.load(GS + offs_n, mask=mask_n, other=0.0)[None, :]
        store_tile(acc, Y, BIAS, offs_m, offs_n, mask_m, mask_n, N, pid_k, HAS_BIAS, SPLIT_K, BF16_INTERP)

    return jit(tile_fp4_kernel)
