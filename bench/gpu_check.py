"""GPU kernel check: correctness against the torch twins and speed against cuBLAS bf16, on CUDA.

    python bench/gpu_check.py                 # needs a CUDA GPU: check + time every kernel, save JSON
    python bench/gpu_check.py --compile-only  # no GPU needed: compile every kernel for sm80/sm90
                                              # (and sm89 for fp8) with the default launch configs,
                                              # and check shared memory against each arch's limit

Timing: triton.testing.do_bench (median ms) of each kernel's `apply` (activation quantization and
act-order permutation included) against `x @ w.T` with a dense bf16 weight (cuBLAS) of the same
shape in the same run; ratio = t_bf16 / t_kernel (> 1: faster than bf16). Shapes N x K: 4096 x 4096,
4096 x 14336 and 14336 x 4096; M in {1, 16, 64, 256}. Error: relative Frobenius error of the kernel
against its torch twin (dequantized fp32 weight, fp32 matmul; fp8_w8a8's twin also quantizes the
activations per token). Results: bench/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if "--compile-only" in sys.argv:  # compile for real targets: the interpreter must stay off
    os.environ.pop("TRITON_INTERPRET", None)

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.base import FP4_GROUP_SIZE, Fp4Weight, Fp8Weight, IntWeight, LinearSpec, Target  # noqa: E402
from kernels.codecs.fp4 import quantize_fp4  # noqa: E402
from kernels.codecs.fp8 import quantize_fp8  # noqa: E402
from kernels.registry import get_kernel  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu_check.json"
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672))  # (N, K)
MS = (1, 16, 64, 256)
# Goals (speed-up over cuBLAS bf16 of the same shape, the worst shape counts): (label, M values, ratio)
GOALS = (
    ("tile W4A16 g128", (1,), 2.5),
    ("tile W4A16 g128", (16,), 2.0),
    ("fp8_w8a8 channel (triton)", (1,), 1.3),
    ("fp8_w8a8 channel (triton)", (256,), 1.6),
    ("tile_fp4 nvfp4", (1,), 2.5),
    ("tile_fp4 mxfp4", (1,), 2.5),
)
HOST_GOAL_MS = 0.03  # host cost of one layer call at M = 1 (Python, launches), eager
# apply vs twin, relative Frobenius error (bf16 output rounding + weights rounded to bf16 before the dot)
REL_TOL = 1.5e-2
# opt-in shared memory per block, bytes
SMEM_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class Variant:
    label: str
    kernel: str
    scheme: str
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    fp8_strategy: str | None = None
    block_size: tuple[int, int] | None = None
    backend: str = "triton"  # fp8_w8a8 only: "triton" or "scaled_mm"
    int8_activations: bool = False  # int8_w8a8: the layer declares per-token int8 activations
    fp4_format: str | None = None  # scheme "fp4": "nvfp4" | "mxfp4"
    codebook: str = ""  # "nf4": bitsandbytes' value table (tile_lut4)

    def spec(self, n: int, k: int) -> LinearSpec:
        if self.scheme == "fp4":
            assert self.fp4_format is not None
            return LinearSpec(
                name=self.label, scheme="fp4", n=n, k=k, bits=4, group_size=FP4_GROUP_SIZE[self.fp4_format],
                act_dtype="bfloat16", fp4_format=self.fp4_format,  # type: ignore[arg-type]
            )  # fmt: skip
        return LinearSpec(
            name=self.label,
            scheme=self.scheme,  # type: ignore[arg-type]
            n=n,
            k=k,
            bits=self.bits if self.scheme == "int" else 8,
            group_size=self.group_size if self.scheme == "int" else -1,
            symmetric=self.symmetric,
            act_order=self.act_order,
            fp8_strategy=self.fp8_strategy,  # type: ignore[arg-type]
            block_size=self.block_size,
            act_dtype="bfloat16",
            int8_activations=self.int8_activations,
            codebook=self.codebook,
        )


VARIANTS = (
    Variant("tile W4A16 g128", "tile_wna16", "int"),
    Variant("tile W4A16 asym g128", "tile_wna16", "int", symmetric=False),
    Variant("tile W8A16 channel", "tile_wna16", "int", bits=8, group_size=-1),
    Variant("tile W6A16 g16 (GGUF Q6_K, byte codes)", "tile_wna16", "int", bits=6, group_size=16),
    Variant("tile_lut4 nf4 g64 (bitsandbytes)", "tile_lut4", "int", group_size=64, codebook="nf4"),
    Variant("gptq W6A16 g16 (GGUF Q6_K, byte codes)", "gptq_wna16", "int", bits=6, group_size=16),
    Variant("tile W4A16 asym g128 act-order", "tile_wna16", "int", symmetric=False, act_order=True),
    Variant("marlin W4A16 g128", "marlin_wna16", "int"),
    Variant("marlin W4A16 asym g128 act-order", "marlin_wna16", "int", symmetric=False, act_order=True),
    Variant("marlin W8A16 channel", "marlin_wna16", "int", bits=8, group_size=-1),
    Variant("gptq W4A16 g128", "gptq_wna16", "int"),
    Variant("gptq W4A16 asym g128", "gptq_wna16", "int", symmetric=False),
    Variant("fp8_w8a8 channel (triton)", "fp8_w8a8", "fp8", fp8_strategy="channel"),
    Variant("fp8_w8a8 channel (_scaled_mm)", "fp8_w8a8", "fp8", fp8_strategy="channel", backend="scaled_mm"),
    Variant("int8_w8a8 channel", "int8_w8a8", "int", bits=8, group_size=-1, int8_activations=True),
    Variant("fp8_marlin channel", "fp8_marlin", "fp8", fp8_strategy="channel"),
    Variant("fp8_marlin block 128", "fp8_marlin", "fp8", fp8_strategy="block", block_size=(128, 128)),
    Variant("fp8_w8a16 channel", "fp8_w8a16", "fp8", fp8_strategy="channel"),
    Variant("fp8_w8a16 block 128", "fp8_w8a16", "fp8", fp8_strategy="block", block_size=(128, 128)),
    Variant("tile_fp4 nvfp4", "tile_fp4", "fp4", fp4_format="nvfp4"),
    Variant("tile_fp4 mxfp4", "tile_fp4", "fp4", fp4_format="mxfp4"),
    Variant("marlin_fp4 nvfp4", "marlin_fp4", "fp4", fp4_format="nvfp4"),
    Variant("marlin_fp4 mxfp4", "marlin_fp4", "fp4", fp4_format="mxfp4"),
)


def make_weight(v: Variant, n: int, k: int, dense: torch.Tensor) -> IntWeight | Fp8Weight | Fp4Weight:
    """Quantize a dense (N, K) weight into the canonical form the variant's kernel prepares."""
    if v.scheme == "fp4":
        assert v.fp4_format is not None
        codes, scales, global_scale = quantize_fp4(dense, v.fp4_format)
        return Fp4Weight(codes, scales, v.fp4_format, global_scale)  # type: ignore[arg-type]
    if v.scheme == "fp8":
        return quantize_fp8(dense, v.fp8_strategy, block_size=v.block_size or (128, 128))  # type: ignore[arg-type]
    g = k if v.group_size == -1 else v.group_size
    groups = k // g
    if v.codebook:  # NF4: the nearest of 16 normal quantiles of each group's absmax-scaled weights
        table = torch.erfinv(torch.linspace(-0.92, 0.92, 16, dtype=torch.float64)).float()
        table = table / table.abs().max()
        absmax = dense.reshape(n, groups, g).abs().amax(-1).clamp(min=1e-8)  # (N, G)
        scaled = dense.reshape(n, groups, g) / absmax[..., None]
        codes = (scaled[..., None] - table).abs().argmin(-1).reshape(n, k).to(torch.uint8)
        return IntWeight(codes, absmax.T.contiguous(), 4, g, codebook=table)
    # act-order: channel c belongs to group g_idx[c]; quantize each group's (scattered) channels
    g_idx = (torch.randperm(k) // g).to(torch.int32) if v.act_order else None
    order = torch.argsort(g_idx.long(), stable=True) if g_idx is not None else torch.arange(k)
    wg = dense[:, order].reshape(n, groups, g)
    qmax = (1 << v.bits) - 1
    if v.symmetric:
        scales = wg.abs().amax(-1).clamp(min=1e-8) / (qmax // 2 + 0.5)
        zeros = None
        codes = torch.clamp(torch.round(wg / scales[..., None]) + (1 << (v.bits - 1)), 0, qmax)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scales = (hi - lo).clamp(min=1e-5) / qmax
        zp = torch.clamp(torch.round(-lo / scales), 0, qmax)
        zeros = zp.T.to(torch.uint8).contiguous()
        codes = torch.clamp(torch.round(wg / scales[..., None]) + zp[..., None], 0, qmax)
    codes_orig = torch.empty(n, k, dtype=torch.uint8)
    codes_orig[:, order] = codes.reshape(n, k).to(torch.uint8)
    return IntWeight(
        codes=codes_orig,
        scales=scales.T.contiguous().to(torch.bfloat16),
        bits=v.bits,
        group_size=v.group_size,
        zeros=zeros,
        g_idx=g_idx,
    )


def bench(fn: Any, *args: Any) -> float:
    """Median milliseconds of fn(*args) (triton.testing.do_bench: CUDA events, L2 flushed per rep)."""
    import triton.testing

    return float(triton.testing.do_bench(lambda: fn(*args), return_mode="median"))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def run_gpu(args: argparse.Namespace) -> int:
    from kernels.codecs.int8 import quantize_per_token_int8
    from kernels.fp8_w8a8 import quantize_per_token_reference, scaled_mm_gemm

    token_quant = {"fp8_w8a8": quantize_per_token_reference, "int8_w8a8": quantize_per_token_int8}
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    target_cc = cap[0] * 10 + cap[1]
    target = max((t for t in Target if t.is_gpu and t.capability <= target_cc), key=lambda t: t.capability)
    print(f"device: {torch.cuda.get_device_name()} (sm{target_cc}), torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    ms_list = args.m or MS
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    for n, k in () if args.moe_only else shapes:
        dense = torch.randn(n, k) * 0.02
        w_bf16 = dense.to(dev, torch.bfloat16)
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in ms_list}
        base = {m: bench(torch.matmul, xs[m], w_bf16.T) for m in ms_list}
        for m in ms_list:
            rows.append(
                {
                    "kernel": "torch bf16 (cuBLAS)",
                    "M": m,
                    "N": n,
                    "K": k,
                    "ms": base[m],
                    "ratio": 1.0,
                    "rel_err": 0.0,
                }
            )
        for v in VARIANTS:
            if v.fp8_strategy and v.kernel == "fp8_w8a8" and target_cc < 89:
                continue
            if args.only and not any(part in v.label for part in args.only):
                continue
            kern = get_kernel(v.kernel)
            spec = v.spec(n, k)
            t0 = time.perf_counter()
            tensors_cpu = kern.prepare(make_weight(v, n, k, dense), spec, target)
            prep_s = time.perf_counter() - t0
            tensors = {name: t.to(dev) for name, t in tensors_cpu.items()}
            w_ref = kern.dequantize(tensors_cpu, spec).to(dev)  # (N, K) fp32
            if v.backend == "scaled_mm":
                fn = scaled_mm_gemm
            else:
                bound = kern.bind_apply(tensors, spec)  # as the runtime calls a layer

                def fn(x: torch.Tensor, _t: Any, _s: Any, bound: Any = bound) -> torch.Tensor:
                    return bound(x)

            for m in ms_list:
                x = xs[m]
                if v.kernel in token_quant:
                    q, s = token_quant[v.kernel](x)
                    ref = (q.float() * s[:, None]) @ w_ref.T
                else:
                    ref = x.float() @ w_ref.T
                try:
                    y = fn(x, tensors, spec)
                    torch.cuda.synchronize()
                    err = rel_err(y, ref)
                    t = bench(fn, x, tensors, spec)
                except Exception as exc:  # report every failing kernel, keep measuring the others
                    failures.append(f"{v.label} M={m} {n}x{k}: {type(exc).__name__}: {exc}")
                    continue
                if not err < REL_TOL:
                    failures.append(f"{v.label} M={m} {n}x{k}: rel err {err:.3e} >= {REL_TOL}")
                host = host_ms(fn, x, tensors, spec) if m == 1 else None
                rows.append(
                    {
                        "kernel": v.label,
                        "M": m,
                        "N": n,
                        "K": k,
                        "ms": t,
                        "ratio": base[m] / t,
                        "rel_err": err,
                        "prepare_s": prep_s,
                        "host_ms": host,
                    }
                )
                print(
                    f"{v.label:34s} M={m:<4d} {n:>5d}x{k:<5d} {t:8.4f} ms  x{base[m] / t:5.2f}  "
                    f"err {err:.2e}" + (f"  host {host:.4f} ms" if host is not None else ""),
                    flush=True,
                )
    print_table(rows)
    moe_rows = [] if args.skip_moe else run_moe(target, ms_list, failures)
    print_goals(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "capability": target_cc,
                "rows": rows,
                "moe_rows": moe_rows,
                "failures": failures,
            },
            indent=1,
        )
    )
    print(f"saved {RESULTS}")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# Fused MoE kernels (GPU only): one layer's expert MLP, fused vs the per-expert loop vs bf16
# ---------------------------------------------------------------------------------------------

# (label, experts, top_k, hidden, intermediate per expert): Mixtral-8x7B at TP4, Qwen3-30B-A3B
MOE_SHAPES = (("E8 k2 4096x3584", 8, 2, 4096, 3584), ("E128 k8 2048x768", 128, 8, 2048, 768))
MOE_DISTINCT = 4  # experts prepared on the CPU per layer, repeated (at distinct addresses) up to E
MOE_FP8_ACT_QUANT_REL_TOL = 8e-2  # fp8_moe_w8a8: two per-token e4m3 activation roundings


@dataclass(frozen=True)
class MoEVariant:
    label: str
    fused: str  # the fused kernel; the per-expert loop is `<its based_on>_experts`
    linear: Variant  # quantization of each expert's w13 / w2
    min_cc: int = 80


MOE_VARIANTS = (
    MoEVariant("marlin_moe W4A16 g128", "marlin_moe_wna16", Variant("moe", "marlin_wna16", "int")),
    MoEVariant(
        "fp8_moe_w8a8 channel",
        "fp8_moe_w8a8",
        Variant("moe", "fp8_w8a8", "fp8", fp8_strategy="channel"),
        min_cc=89,
    ),
    MoEVariant(
        "fp8_moe_w8a16 channel", "fp8_moe_w8a16", Variant("moe", "fp8_w8a16", "fp8", fp8_strategy="channel")
    ),
    MoEVariant(
        "fp8_marlin_moe channel",
        "fp8_marlin_moe",
        Variant("moe", "fp8_marlin", "fp8", fp8_strategy="channel"),
    ),
)


def _tiled(one: list[dict[str, torch.Tensor]], experts: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """E stacked experts on `dev` from a few prepared ones (expert e is one[e % len(one)])."""
    return {n: torch.stack([one[e % len(one)][n] for e in range(experts)]).to(dev) for n in one[0]}


def _moe_reference(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, deq: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """fp32 expert MLP on the dequantized experts (expert e's weights are deq[e % len(deq)])."""
    from kernels.moe_base import swiglu

    out = torch.zeros(x.shape[0], deq[0][1].shape[0], device=x.device)
    for d, (w13, w2) in enumerate(deq):
        token, slot = torch.nonzero(ids % len(deq) == d, as_tuple=True)
        if token.numel():
            y = swiglu(x[token].float() @ w13.T) @ w2.T
            out.index_add_(0, token, y * weights[token, slot].float()[:, None])
    return out


def run_moe(target: Target, ms_list: Any, failures: list[str], device: str = "cuda") -> list[dict[str, Any]]:
    """Time each fused MoE kernel's `apply` (route sort, both grouped GEMMs, silu, top-k sum) against
    the per-expert loop on the same stored tensors and against `dense_experts` on bf16 weights (the
    same loop on cuBLAS); error against an fp32 MoE on the dequantized experts."""
    from kernels.base import DenseWeight
    from kernels.moe_base import MoESpec
    from kernels.registry import MOE_KERNELS

    dev = torch.device(device)
    out: list[dict[str, Any]] = []
    for shape, e_num, top_k, h, inter in MOE_SHAPES:
        dense = [
            (torch.randn(2 * inter, h) * 0.02, torch.randn(h, inter) * 0.02) for _ in range(MOE_DISTINCT)
        ]
        xs = {m: torch.randn(m, h, device=dev, dtype=torch.bfloat16) for m in ms_list}
        route = {}
        for m in ms_list:
            ids = torch.stack([torch.randperm(e_num)[:top_k] for _ in range(m)]).to(dev)
            route[m] = (ids, torch.softmax(torch.randn(m, top_k, device=dev), -1))
        specs = {
            v.kernel: MoESpec(shape, e_num, top_k, v.spec(2 * inter, h), v.spec(h, inter))
            for v in (Variant("moe", "dense", "dense"), *(mv.linear for mv in MOE_VARIANTS))
        }
        base_kernel, base_spec = MOE_KERNELS["dense_experts"], specs["dense"]
        base_one = [
            base_kernel.prepare_expert(
                DenseWeight(a.bfloat16()), DenseWeight(b.bfloat16()), base_spec, target
            )
            for a, b in dense
        ]
        base_tensors = _tiled(base_one, e_num, dev)
        base = {m: bench(base_kernel.apply, xs[m], *route[m], base_tensors, base_spec) for m in ms_list}
        for m in ms_list:
            out.append({"kernel": "dense_experts bf16 (cuBLAS loop)", "shape": shape, "M": m, "ms": base[m]})
        for mv in MOE_VARIANTS:
            if target.capability < mv.min_cc:
                continue
            fused, spec = MOE_KERNELS[mv.fused], specs[mv.linear.kernel]
            ok, why = fused.can_implement(spec, target)
            if not ok:
                failures.append(f"{mv.label} {shape}: refused: {why}")
                continue
            loop = MOE_KERNELS[f"{fused.based_on}_experts"]
            v = mv.linear
            one = [
                fused.prepare_expert(
                    make_weight(v, 2 * inter, h, a), make_weight(v, h, inter, b), spec, target
                )
                for a, b in dense
            ]
            tensors = _tiled(one, e_num, dev)
            deq = [
                tuple(w.to(dev) for w in fused.dequantize_expert({n: t[None] for n, t in o.items()}, spec, 0))
                for o in one
            ]
            tol = MOE_FP8_ACT_QUANT_REL_TOL if mv.fused == "fp8_moe_w8a8" else REL_TOL
            for m in ms_list:
                x, (ids, weights) = xs[m], route[m]
                try:
                    y = fused.apply(x, ids, weights, tensors, spec)
                    if y.is_cuda:
                        torch.cuda.synchronize()
                    err = rel_err(y, _moe_reference(x, ids, weights, deq))  # type: ignore[arg-type]
                    t_fused = bench(fused.apply, x, ids, weights, tensors, spec)
                    t_loop = bench(loop.apply, x, ids, weights, tensors, spec)
                except Exception as exc:  # report every failing kernel, keep measuring the others
                    failures.append(f"{mv.label} M={m} {shape}: {type(exc).__name__}: {exc}")
                    continue
                if not err < tol:
                    failures.append(f"{mv.label} M={m} {shape}: rel err {err:.3e} >= {tol}")
                out.append(
                    {
                        "kernel": mv.label,
                        "shape": shape,
                        "M": m,
                        "ms": t_fused,
                        "loop_ms": t_loop,
                        "vs_loop": t_loop / t_fused,
                        "vs_bf16": base[m] / t_fused,
                        "rel_err": err,
                    }
                )
                print(
                    f"{mv.label:24s} {shape:18s} M={m:<4d} {t_fused:8.4f} ms  loop {t_loop:8.4f} ms  "
                    f"x{t_loop / t_fused:5.2f} vs loop  x{base[m] / t_fused:5.2f} vs bf16  err {err:.2e}",
                    flush=True,
                )
    return out


# --sweep: launch configs of the dequant GEMMs at decode sizes (is a slow kernel its config or its design?)
SWEEP_KERNELS = ("tile_wna16", "tile_fp4", "marlin_wna16", "gptq_wna16")
# the variant each swept kernel is timed on
SWEEP_VARIANT = {
    "tile_wna16": "tile W4A16 g128",
    "tile_fp4": "tile_fp4 nvfp4",
    "marlin_wna16": "marlin W4A16 g128",
    "gptq_wna16": "gptq W4A16 g128",
}
SWEEP_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # a square, a wide-K and a wide-N shape
SWEEP_MS = (1, 16)


def sweep_configs() -> list[Any]:
    from kernels.launch import GemmConfig

    return [
        GemmConfig(16, bn, bk, split_k=sk, num_warps=4, num_stages=4)
        for bn in (64, 128)
        for bk in (64, 128)
        for sk in (1, 4, 16)
    ]


def run_sweep(kernels: tuple[str, ...] = SWEEP_KERNELS, device: str = "cuda") -> int:
    """Each kernel's default config and every sweep config, timed against cuBLAS bf16 (M = 1, 16);
    the kernels of kernels/launch_table.py (tile_wna16, tile_fp4) sweep its candidates and print their
    winners as table entries."""
    import importlib

    from kernels.launch import default_config, sm_count
    from kernels.launch_table import LAUNCH_TABLE, SWEEP, occupancy_split_k, shape_class, tuned_config

    gemm = {n: getattr(importlib.import_module(f"kernels.{n}"), f"{n}_gemm") for n in kernels}
    arch = (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability())
    tabled = {e.kernel for e in LAUNCH_TABLE}
    winners: dict[tuple[str, int, str], list[tuple[float, Any]]] = {}
    dev = torch.device(device)
    torch.manual_seed(0)
    out = []
    for n, k in SWEEP_SHAPES:
        dense = torch.randn(n, k) * 0.02
        w_bf16 = dense.to(dev, torch.bfloat16)
        for name in kernels:
            v = next(v for v in VARIANTS if v.label == SWEEP_VARIANT[name])
            kern, spec = get_kernel(name), v.spec(n, k)
            tensors = {
                t: x.to(dev) for t, x in kern.prepare(make_weight(v, n, k, dense), spec, Target.SM90).items()
            }
            for m in SWEEP_MS:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                base = bench(torch.matmul, x, w_bf16.T)
                if name in tabled:
                    default = tuned_config(name, m, n, k, dev)
                    sms = sm_count(dev.index or 0)
                    candidates = [
                        replace(c, split_k=c.split_k or occupancy_split_k(c, m, n, k, sms)) for c in SWEEP[m]
                    ]
                else:
                    default, candidates = default_config(m, n, k, dev), sweep_configs()
                timed = []
                for cfg in (default, *candidates):
                    try:
                        timed.append((bench(gemm[name], x, tensors, spec, cfg), cfg))
                    except Exception as exc:  # a config the kernel cannot take (shared memory, tiles)
                        print(f"  {name} {cfg}: {type(exc).__name__}", flush=True)
                best_t, best = min(timed, key=lambda tc: tc[0])
                d_t = timed[0][0]
                print(
                    f"sweep {name:13s} {n:>5d}x{k:<5d} M={m:<3d} bf16 {base:.4f} ms | default {d_t:.4f} ms "
                    f"x{base / d_t:4.2f} {default} | best {best_t:.4f} ms x{base / best_t:4.2f} {best}",
                    flush=True,
                )
                out.append({"kernel": name, "N": n, "K": k, "M": m, "bf16_ms": base, "default_ms": d_t,
                            "best_ms": best_t, "best": str(best), "default": str(default)})  # fmt: skip
                if name in tabled:
                    winners.setdefault((name, m, shape_class(n, k)), []).append((best_t / base, best))
    RESULTS.with_name("gpu_sweep.json").write_text(json.dumps({"arch": arch, "rows": out}, indent=1))
    if winners:
        print(f"# kernels/launch_table.py entries measured on sm{arch} (best per M bucket and shape class):")
        for (name, m, shape), found in sorted(winners.items()):
            _, cfg = min(found, key=lambda f: f[0])
            print(f'    LaunchEntry("{name}", {m}, {cfg!r}, shape="{shape}", arch={arch}),')
    return 0


def host_ms(fn: Any, x: torch.Tensor, tensors: Any, spec: Any, calls: int = 200) -> float:
    """Host milliseconds per layer call (Python, argument handling, launches), no synchronization
    inside: what a step pays per layer when its launches are not captured in a CUDA graph."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x, tensors, spec)
    host = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return host


def print_goals(rows: list[dict[str, Any]]) -> None:
    """Each goal of GOALS (worst shape) and the host cost of every kernel at M = 1 against HOST_GOAL_MS."""
    for label, ms, goal in GOALS:
        got = [r["ratio"] for r in rows if r["kernel"] == label and r["M"] in ms]
        if got:
            verdict = "met" if min(got) >= goal else "NOT met"
            print(f"goal {label} >= {goal}x bf16 at M={ms}: worst {min(got):.2f}x over shapes -> {verdict}")
    hosts: dict[str, float] = {}
    for r in rows:
        if r.get("host_ms") is not None:
            hosts[r["kernel"]] = max(hosts.get(r["kernel"], 0.0), r["host_ms"])
    for label, worst in hosts.items():
        verdict = "met" if worst <= HOST_GOAL_MS else "NOT met"
        print(f"host cost {label} at M=1: {worst:.4f} ms per call (goal <= {HOST_GOAL_MS}) -> {verdict}")


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'kernel':34s} {'M':>4s} {'N x K':>12s} {'ms':>9s} {'vs bf16':>8s} {'rel err':>9s}")
    for r in rows:
        print(
            f"{r['kernel']:34s} {r['M']:>4d} {r['N']:>5d}x{r['K']:<6d} {r['ms']:9.4f} "
            f"{r['ratio']:7.2f}x {r['rel_err']:9.2e}"
        )


# ---------------------------------------------------------------------------------------------
# --compile-only: ahead-of-time compilation for real targets, no GPU required
# ---------------------------------------------------------------------------------------------


def compile_kernel(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int, num_warps: int, num_stages: int
) -> int:
    """Compile one specialization to a cubin for `sm{arch}`; returns its shared memory in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)  # the kernel's parameter order
    missing = set(names) - set(signature) - set(constexprs)
    if missing:
        raise ValueError(f"no signature or constexpr value for {sorted(missing)}")
    sig = {name: signature.get(name, "constexpr") for name in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    return int(compiled.metadata.shared)


def compile_matrix(quick: bool) -> list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]]:
    """(label, arch, fn, signature, constexprs, config) for every kernel variant and M bucket."""
    from kernels import fp8_marlin, fp8_w8a8, fp8_w8a16, gptq_wna16, int8_w8a8, marlin_wna16
    from kernels.launch import GemmConfig, cuda_block_config, fit_to_groups, largest_block_dividing

    act = "bf16"
    ptrs = {"X": f"*{act}", "QW": "*i32", "S": f"*{act}"}
    ints = {"M": "i32", "N": "i32", "K": "i32", "group_size": "i32"}
    gptq_sig = {**ptrs, "QZ": "*i32", "GIDX": "*i32", "BIAS": f"*{act}", "Y": f"*{act}", **ints}
    marlin_sig = {**ptrs, "ZP": "*i32", "GIDX": "*i32", "BIAS": f"*{act}", "Y": f"*{act}", **ints}
    fp8m_sig = {**ptrs, "BIAS": f"*{act}", "Y": f"*{act}", **ints, "unbias": "fp32"}
    w8a8_sig = {
        "XQ": "*fp8e4nv",
        "XS": "*fp32",
        "W": "*fp8e4nv",
        "WS": "*fp32",
        "BIAS": f"*{act}",
        "Y": f"*{act}",
        "M": "i32",
        "N": "i32",
        "K": "i32",
    }
    int8_sig = {**w8a8_sig, "XQ": "*i8", "W": "*i8"}
    w8a16_ints = {"M": "i32", "N": "i32", "K": "i32", "block_n": "i32", "block_k": "i32", "k_blocks": "i32"}
    w8a16_sig = {"X": f"*{act}", "W": "*u8", "S": "*fp32", "BIAS": f"*{act}", "Y": f"*{act}", **w8a16_ints}
    w8a16_sig_fp16 = {**w8a16_sig, "X": "*fp16", "BIAS": "*fp16", "Y": "*fp16"}
    ms = (1, 256) if quick else MS
    out: list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]] = []
    int_variants = [(4, True, False, 128), (8, False, True, 128)] + ([] if quick else [(2, True, False, 40)])
    for m in ms:
        for split_k in (1, 2) if m == 1 else (1,):
            base = cuda_block_config(m)
            for bits, zp, act_order, group in int_variants:
                cfg, per_block = fit_to_groups(base, group, act_order=act_order)
                cfg = replace(cfg, split_k=split_k)
                common = dict(
                    HAS_ZP=zp,
                    ACT_ORDER=act_order,
                    PER_BLOCK_SCALE=per_block,
                    HAS_BIAS=True,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k,
                    SPLIT_K=split_k,
                    BF16_INTERP=False,
                )
                label = f"M={m} split={split_k} {bits}-bit zp={zp} act_order={act_order} g{group}"
                for arch in (80, 90):
                    out.append(
                        (
                            f"gptq_wna16 {label}",
                            arch,
                            gptq_wna16._kernel(),
                            gptq_sig,
                            {"BITS": bits, **common},
                            cfg,
                        )
                    )
                    if bits in (4, 8) and (bits == 4 or not zp):
                        out.append(
                            (
                                f"marlin_wna16 {label}",
                                arch,
                                marlin_wna16._kernel(),
                                marlin_sig,
                                {
                                    "BITS": bits,
                                    **{k: v for k, v in common.items() if k != "ACT_ORDER"},
                                    "ACT_ORDER": act_order,
                                    "GROUPED_SCALES": group != -1,
                                },
                                cfg,
                            )
                        )
            for group in (128, 4096):
                cfg, per_block = fit_to_groups(base, group, act_order=False)
                cfg = replace(cfg, split_k=split_k)
                consts = dict(
                    GROUPED_SCALES=group < 4096,
                    PER_BLOCK_SCALE=per_block,
                    HAS_BIAS=True,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k,
                    SPLIT_K=split_k,
                    BF16_INTERP=False,
                )
                for arch in (80, 90):
                    out.append(
                        (
                            f"fp8_marlin M={m} split={split_k} g{group}",
                            arch,
                            fp8_marlin._kernel(),
                            fp8m_sig,
                            consts,
                            cfg,
                        )
                    )
            cfg = replace(base, block_k=largest_block_dividing(128, base.block_k), split_k=split_k)
            for block_scales in (False, True):
                consts = dict(
                    BLOCK_SCALES=block_scales,
                    HAS_BIAS=True,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k,
                    SPLIT_K=split_k,
                    BF16_INTERP=False,
                )
                for arch, sig in ((75, w8a16_sig_fp16), (80, w8a16_sig), (90, w8a16_sig)):  # sm75: fp16 only
                    out.append(
                        (
                            f"fp8_w8a16 M={m} split={split_k} block_scales={block_scales}",
                            arch,
                            fp8_w8a16._kernel(),
                            sig,
                            consts,
                            cfg,
                        )
                    )
            cfg = replace(cuda_block_config(m, "fp8"), split_k=split_k)
            for per_channel in (True, False):
                consts = dict(
                    PER_CHANNEL=per_channel,
                    HAS_BIAS=True,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k,
                    SPLIT_K=split_k,
                    BF16_INTERP=False,
                )
                for arch in (89, 90):
                    out.append(
                        (
                            f"fp8_w8a8 M={m} split={split_k} per_channel={per_channel}",
                            arch,
                            fp8_w8a8._gemm_kernel(),
                            w8a8_sig,
                            {**consts, "INT8": False},
                            cfg,
                        )
                    )
                if per_channel:  # int8_w8a8: channelwise weight scales only
                    for arch in (80, 90):
                        out.append(
                            (
                                f"int8_w8a8 M={m} split={split_k}",
                                arch,
                                fp8_w8a8._gemm_kernel(),
                                int8_sig,
                                {**consts, "INT8": True},
                                cfg,
                            )
                        )
    out += tile_compile_matrix(quick)
    out += w8a8_prologue_compile_matrix(act)
    out += moe_compile_matrix(quick)
    quant_sig = {"X": f"*{act}", "Q": "*fp8e4nv", "S": "*fp32", "K": "i32"}
    for arch in (89, 90):
        cfg = GemmConfig(16, 16, 16, num_warps=4, num_stages=1)
        out.append(
            (
                "fp8 per-token quant",
                arch,
                fp8_w8a8._quant_kernel(),
                quant_sig,
                {"BLOCK": 4096, "INTERPRET": False},
                cfg,
            )
        )
    int8_quant_sig = {
        "X": f"*{act}", "Q": "*i8", "S": "*fp32", "K": "i32",
        "min_amax": "fp32", "divisor": "fp32", "qmax": "fp32",
    }  # fmt: skip
    for arch in (80, 90):
        cfg = GemmConfig(16, 16, 16, num_warps=4, num_stages=1)
        out.append(
            ("int8 per-token quant", arch, int8_w8a8._quant_kernel(), int8_quant_sig, {"BLOCK": 4096}, cfg)
        )
    return out


def tile_compile_matrix(quick: bool) -> list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]]:
    """tile_wna16 at every entry of the launch table for each GPU target's arch (fp16 on sm75, bf16
    from sm80; 4-bit symmetric / asymmetric / float minimum, 8-bit) and, unless quick, the sweep's
    candidates (4-bit symmetric) for sm80 / sm90."""
    from kernels import tile_wna16
    from kernels.launch_table import LAUNCH_TABLE, SWEEP

    table = [(e.m_max, e.config) for e in LAUNCH_TABLE if e.kernel == "tile_wna16"]
    swept = [(m, c) for m, cands in SWEEP.items() for c in cands]
    variants = [(4, tile_wna16.SYMMETRIC), (4, tile_wna16.INT_ZEROS), (8, tile_wna16.SYMMETRIC)]
    if not quick:  # float minimums (GGUF Q4_1 / Q4_K; 5/6-bit ones run as 8-bit), value tables (NF4 / FP4)
        variants += [(4, tile_wna16.FLOAT_MINS), (8, tile_wna16.FLOAT_MINS), (4, tile_wna16.CODEBOOK)]
    out: list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]] = []
    for arch in (75, 80, 86, 89, 90) if not quick else (80, 90):
        act = "fp16" if arch == 75 else "bf16"
        for bits, offset in variants:
            configs = table
            if not quick and arch in (80, 90) and (bits, offset) == (4, tile_wna16.SYMMETRIC):
                configs = table + swept
            table_layer = offset == tile_wna16.CODEBOOK  # fp32 absmax and value table
            off = "*u8" if offset == tile_wna16.INT_ZEROS else "*fp32" if table_layer else f"*{act}"
            scales = "*fp32" if table_layer else f"*{act}"
            sig = {"X": f"*{act}", "QW": "*i32", "S": scales, "OFF": off, "BIAS": f"*{act}",
                   "Y": f"*{act}", "M": "i32", "N": "i32", "K": "i32", "group_size": "i32"}  # fmt: skip
            for m_max, cfg in configs:
                split = cfg.split_k if cfg.split_k > 0 else 4
                consts = dict(
                    BITS=bits, OFFSET=offset, HAS_BIAS=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k, SPLIT_K=split, BF16_INTERP=False,
                )  # fmt: skip
                tile = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
                label = f"tile_wna16 M<={min(m_max, 9999)} {bits}-bit offset={offset} {tile} split={split}"
                out.append((label, arch, tile_wna16._kernel(), sig, consts, cfg))
    return out + tile_fp4_compile_matrix(quick)


def w8a8_prologue_compile_matrix(act: str) -> list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]]:
    """The W8A8 GEMM that quantizes its activations in its prologue (M <= FUSED_QUANT_MAX_M): e4m3 on
    sm89 / sm90, int8 on sm80 / sm90, at the decode config with and without K splits."""
    from kernels import fp8_w8a8
    from kernels.launch import cuda_block_config

    out: list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]] = []
    cfg = cuda_block_config(fp8_w8a8.FUSED_QUANT_MAX_M, "fp8")
    for int8, archs in ((False, (89, 90)), (True, (80, 90))):
        sig = {"X": f"*{act}", "W": "*i8" if int8 else "*fp8e4nv", "WS": "*fp32", "BIAS": f"*{act}",
               "Y": f"*{act}", "M": "i32", "N": "i32", "K": "i32", "min_amax": "fp32", "divisor": "fp32",
               "qmax": "fp32"}  # fmt: skip
        for split_k in (1, 4):
            consts = dict(
                PER_CHANNEL=True, HAS_BIAS=True, INT8=int8, INTERPRET=False, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, BF16_INTERP=False,
            )  # fmt: skip
            for arch in archs:
                label = f"{'int8' if int8 else 'fp8'}_w8a8 prologue quant M<=16 split={split_k}"
                out.append((label, arch, fp8_w8a8._fused_gemm_kernel(), sig, consts, cfg))
    return out


def tile_fp4_compile_matrix(quick: bool) -> list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]]:
    """tile_fp4 at every entry of the launch table, NVFP4 and MXFP4, bf16, for sm80 / sm86 / sm89 / sm90
    (quick: sm80 / sm90)."""
    from kernels import tile_fp4
    from kernels.launch_table import LAUNCH_TABLE

    table = [(e.m_max, e.config) for e in LAUNCH_TABLE if e.kernel == "tile_fp4"]
    act = "bf16"
    sig = {"X": f"*{act}", "QW": "*i32", "S": "*u8", "GS": "*fp32", "BIAS": f"*{act}", "Y": f"*{act}",
           "M": "i32", "N": "i32", "K": "i32"}  # fmt: skip
    out: list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]] = []
    for arch in (80, 86, 89, 90) if not quick else (80, 90):
        for fmt, group in FP4_GROUP_SIZE.items():
            for m_max, cfg in table:
                split = cfg.split_k if cfg.split_k > 0 else 4
                block_k = max(cfg.block_k, group)
                consts = dict(
                    GROUP=group, NVFP4=fmt == "nvfp4", HAS_BIAS=True, BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=split, BF16_INTERP=False,
                )  # fmt: skip
                tile = f"{cfg.block_m}x{cfg.block_n}x{block_k}"
                label = f"tile_fp4 M<={min(m_max, 9999)} {fmt} {tile} split={split}"
                out.append((label, arch, tile_fp4._kernel(), sig, consts, replace(cfg, block_k=block_k)))
    return out


def moe_compile_matrix(quick: bool) -> list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]]:
    """The fused MoE kernels (marlin_moe_wna16, fp8_moe_w8a8, fp8_moe_w8a16, fp8_marlin_moe) with the configs
    `moe_config` picks per rows-per-expert bucket; routing-weight epilogue on (the w2 launch)."""
    from kernels.launch import cuda_block_config, fit_to_groups, largest_block_dividing
    from kernels.moe import fp8 as fp8_moe
    from kernels.moe import fp8_marlin as fp8_marlin_moe
    from kernels.moe import marlin as marlin_moe

    act = "bf16"
    routing = {"SORTED": "*i32", "BLOCK_EXPERT": "*i32", "TOPK_W": "*fp32", "Y": f"*{act}"}
    moe_ints = {"num_slots": "i32", "a_div": "i32"}
    marlin_sig = {
        "X": f"*{act}", "QW": "*i32", "S": f"*{act}", "ZP": "*i32", "GIDX": "*i32", "PERM": "*i32",
        **routing, "N": "i32", "K": "i32", "group_size": "i32", **moe_ints,
        "qw_expert_stride": "i32", "s_expert_stride": "i32", "zp_expert_stride": "i32",
    }  # fmt: skip
    w8a8_sig = {
        "XQ": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", **routing,
        "N": "i32", "K": "i32", **moe_ints, "ws_expert_stride": "i32",
    }  # fmt: skip
    w8a16_sig = {
        "X": f"*{act}", "W": "*u8", "S": "*fp32", **routing, "N": "i32", "K": "i32", **moe_ints,
        "s_expert_stride": "i32", "block_n": "i32", "block_k": "i32", "k_blocks": "i32",
    }  # fmt: skip
    w8a16_sig_fp16 = {**w8a16_sig, "X": "*fp16", "Y": "*fp16"}
    fp8_marlin_sig = {
        "X": f"*{act}", "QW": "*i32", "S": f"*{act}", **routing, "N": "i32", "K": "i32", "group_size": "i32",
        "unbias": "fp32", **moe_ints, "qw_expert_stride": "i32", "s_expert_stride": "i32",
    }  # fmt: skip
    out: list[tuple[str, int, Any, dict[str, str], dict[str, Any], Any]] = []
    int_variants = [(4, True, False, 128), (8, False, True, 128)] + ([] if quick else [(4, False, False, -1)])
    for rows in (1, 64) if quick else (1, 32, 64):
        base = cuda_block_config(rows)
        for bits, zp, act_order, group in int_variants:
            cfg, per_block = fit_to_groups(base, 4096 if group == -1 else group, act_order=act_order)
            consts = dict(
                BITS=bits, HAS_ZP=zp, ACT_ORDER=act_order, GROUPED_SCALES=group != -1,
                PER_BLOCK_SCALE=per_block, MUL_WEIGHT=True,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BF16_INTERP=False,
            )  # fmt: skip
            label = f"marlin_moe_wna16 rows={rows} {bits}-bit zp={zp} act_order={act_order} g{group}"
            for arch in (80, 90):
                out.append((label, arch, marlin_moe._kernel(), marlin_sig, consts, cfg))
        cfg = base
        for block_scales in (False, True):
            if block_scales:
                cfg = replace(base, block_k=largest_block_dividing(128, base.block_k))
            consts = dict(
                BLOCK_SCALES=block_scales, MUL_WEIGHT=True,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BF16_INTERP=False,
            )  # fmt: skip
            for arch, sig in ((75, w8a16_sig_fp16), (80, w8a16_sig), (90, w8a16_sig)):  # sm75: fp16 only
                label = f"fp8_moe_w8a16 rows={rows} block_scales={block_scales}"
                out.append((label, arch, fp8_moe._w8a16_kernel(), sig, consts, cfg))
        for group in (-1, 128):  # one scale row (per-tensor / per-channel), 128-wide blocks
            cfg, per_block = fit_to_groups(base, 4096 if group == -1 else group, act_order=False)
            consts = dict(
                GROUPED_SCALES=group != -1, PER_BLOCK_SCALE=per_block, MUL_WEIGHT=True,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BF16_INTERP=False,
            )  # fmt: skip
            label = f"fp8_marlin_moe rows={rows} g{group}"
            out.append((label, 80, fp8_marlin_moe._kernel(), fp8_marlin_sig, consts, cfg))
        cfg = cuda_block_config(rows, "fp8")
        for per_channel in (True, False):
            consts = dict(
                PER_CHANNEL=per_channel, MUL_WEIGHT=True,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BF16_INTERP=False,
            )  # fmt: skip
            for arch in (89, 90):
                label = f"fp8_moe_w8a8 rows={rows} per_channel={per_channel}"
                out.append((label, arch, fp8_moe._w8a8_kernel(), w8a8_sig, consts, cfg))
    return out


def run_compile_only(quick: bool) -> int:
    failures = 0
    t_start = time.perf_counter()
    for label, arch, fn, sig, consts, cfg in compile_matrix(quick):
        t0 = time.perf_counter()
        try:
            smem = compile_kernel(fn, sig, consts, arch, cfg.num_warps, cfg.num_stages)
        except Exception as exc:  # report every specialization that fails to compile
            failures += 1
            print(f"FAIL compile {label} sm{arch}: {type(exc).__name__}: {exc}", flush=True)
            continue
        limits = [SMEM_LIMIT[a] for a in ((80, 86, 89) if arch == 80 else (arch,))]
        over = smem > min(limits)
        failures += over
        print(
            f"{'FAIL' if over else 'ok  '} sm{arch} {label:58s} "
            f"warps={cfg.num_warps} stages={cfg.num_stages} "
            f"smem={smem / 1024:6.1f} KiB (limit {min(limits) / 1024:.0f}) {time.perf_counter() - t0:4.1f}s",
            flush=True,
        )
    print(f"compile check: {failures} failure(s) in {time.perf_counter() - t_start:.0f}s")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="AOT-compile for sm80/89/90; no GPU needed"
    )
    parser.add_argument("--quick", action="store_true", help="with --compile-only: a reduced matrix")
    parser.add_argument("--m", type=int, nargs="*", help=f"M values to time (default {MS})")
    parser.add_argument("--shapes", nargs="*", help="NxK shapes to time (default: all three)")
    parser.add_argument("--moe-only", action="store_true", help="time the fused MoE kernels only")
    parser.add_argument("--sweep", action="store_true", help="launch-config sweep of the W4A16 GEMMs")
    parser.add_argument("--skip-moe", action="store_true", help="skip the fused MoE timings")
    parser.add_argument("--only", nargs="*", help="time the variants whose label contains one of these")
    parser.add_argument("--sweep-kernels", nargs="*", default=list(SWEEP_KERNELS), help="with --sweep")
    args = parser.parse_args()
    if args.compile_only:
        return run_compile_only(args.quick)
    if not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only to check that the kernels compile", file=sys.stderr)
        return 2
    return run_sweep(tuple(args.sweep_kernels)) if args.sweep else run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
