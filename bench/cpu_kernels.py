"""Benchmark the CPU kernels against torch's bf16 and fp32 dense matmul, measured in the same run.

    .venv/bin/python bench/cpu_kernels.py [--reps 30] [--quick]

For each shape (N x K) and M in {1, 8, 32}: ms per call of each kernel's `apply` and of F.linear
in bf16 and fp32, with ratios (peer ms / kernel ms: > 1 means the kernel is faster). Also the FP8
storage candidates that kernels/cpu_fp8.py chose between. Saves bench/results/cpu_kernels.json.

Timing: `reps` calls after a warm-up; the ratios use the fastest call, because this 2-core
machine is shared and a descheduled OpenMP thread stalls a parallel region for a whole scheduler
quantum (≈16 ms spikes); medians are saved too. `--threads 1` avoids those stalls altogether.
The JSON records the thread count and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.base import DenseWeight, Fp8Weight, IntWeight, LinearSpec, Target
from kernels.cpu_fp8 import CpuFp8Kernel
from kernels.cpu_int4 import CpuInt4Kernel
from kernels.cpu_int8 import CpuInt8Kernel
from kernels.dense import DenseKernel

SHAPES = {  # name -> (N, K)
    "2048x2048": (2048, 2048),
    "smollm2 up 576->1536": (1536, 576),
    "smollm2 down 1536->576": (576, 1536),
    "smollm2 o 576->576": (576, 576),
}
MS = (1, 8, 32)
GROUP = 64


def time_ms(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(fastest, median) ms per call."""
    for _ in range(max(3, reps // 5)):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples), statistics.median(samples)


def layers(n: int, k: int) -> dict[str, tuple[object, dict[str, torch.Tensor], LinearSpec]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    out: dict[str, tuple[object, dict[str, torch.Tensor], LinearSpec]] = {}

    g = k // GROUP
    int4 = IntWeight(
        codes=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(g, n, generator=gen) * 0.01).to(torch.bfloat16),
        bits=4,
        group_size=GROUP,
    )
    spec4 = LinearSpec(name="bench", scheme="int", n=n, k=k, bits=4, group_size=GROUP)
    out["cpu_int4 sym g64"] = (CpuInt4Kernel(), CpuInt4Kernel().prepare(int4, spec4, Target.CPU), spec4)
    int4a = IntWeight(
        int4.codes, int4.scales, 4, GROUP, zeros=torch.randint(0, 16, (g, n), generator=gen).byte()
    )
    spec4a = LinearSpec(name="bench", scheme="int", n=n, k=k, bits=4, group_size=GROUP, symmetric=False)
    out["cpu_int4 asym g64"] = (CpuInt4Kernel(), CpuInt4Kernel().prepare(int4a, spec4a, Target.CPU), spec4a)

    int8 = IntWeight(
        codes=torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(1, n, generator=gen) * 0.01).to(torch.bfloat16),
        bits=8,
        group_size=-1,
    )
    spec8 = LinearSpec(name="bench", scheme="int", n=n, k=k, bits=8)
    out["cpu_int8 channel"] = (CpuInt8Kernel(), CpuInt8Kernel().prepare(int8, spec8, Target.CPU), spec8)

    scale = w.abs().amax(1) / 448.0
    fp8 = Fp8Weight((w / scale[:, None]).to(torch.float8_e4m3fn), scale, "channel")
    spec_f8 = LinearSpec(name="bench", scheme="fp8", n=n, k=k, bits=8, fp8_strategy="channel")
    out["cpu_fp8 channel"] = (CpuFp8Kernel(), CpuFp8Kernel().prepare(fp8, spec_f8, Target.CPU), spec_f8)

    spec_d = LinearSpec(name="bench", scheme="dense", n=n, k=k)

    dense_w = DenseWeight(w.to(torch.bfloat16))
    out["dense (fp32 on cpu)"] = (DenseKernel(), DenseKernel().prepare(dense_w, spec_d, Target.CPU), spec_d)
    return out


def fp8_candidates(n: int, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The storage forms kernels/cpu_fp8.py chose between (per-channel scales)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen) * 0.02
    s = w.abs().amax(1) / 448.0
    w8 = (w / s[:, None]).to(torch.float8_e4m3fn)
    wb, wf, wd = w8.to(torch.bfloat16), w8.float(), w8.float() * s[:, None]
    return {
        "(a) e4m3 bytes, widen per call": lambda x: (
            F.linear(x, w8.to(torch.bfloat16)).float() * s
        ).bfloat16(),
        "(b) bf16 values + post-scale": lambda x: (F.linear(x, wb).float() * s).bfloat16(),
        "(c) fp32 values + post-scale": lambda x: (F.linear(x.float(), wf) * s).bfloat16(),
        "(d) fp32 dequantized": lambda x: F.linear(x.float(), wd).bfloat16(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="2048x2048 and M=1 only")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = {"2048x2048": SHAPES["2048x2048"]} if args.quick else SHAPES
    ms_list = (1,) if args.quick else MS

    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.processor() or platform.machine(),
        "loadavg_start": os.getloadavg(),
        "reps": args.reps,
    }
    print(f"torch {env['torch']}, {env['threads']} threads, {env['cpu_capability']}")
    print(f"load average at start {env['loadavg_start']}; ms = fastest of {args.reps} calls (median)")
    rows: list[dict[str, object]] = []
    for shape_name, (n, k) in shapes.items():
        kernels = layers(n, k)
        cands = fp8_candidates(n, k)
        for m in ms_list:
            x = torch.randn(m, k).to(torch.bfloat16)
            w_bf16 = torch.randn(n, k).to(torch.bfloat16)
            w_fp32 = w_bf16.float()
            x32 = x.float()
            bf16_ms, bf16_med = time_ms(lambda x=x, w=w_bf16: F.linear(x, w), args.reps)
            fp32_ms, fp32_med = time_ms(lambda x=x32, w=w_fp32: F.linear(x, w), args.reps)
            print(f"\n{shape_name} (N={n}, K={k}) M={m}:")
            print(f"  {'bf16 F.linear (peer)':40s} {bf16_ms:8.3f} ({bf16_med:.3f}) ms")
            print(f"  {'fp32 F.linear (peer)':40s} {fp32_ms:8.3f} ({fp32_med:.3f}) ms")
            entries = [
                (name, lambda x=x, kern=kern, t=t, s=spec: kern.apply(x, t, s))
                for name, (kern, t, spec) in kernels.items()
            ]
            entries += [(f"fp8 cand {name}", lambda x=x, f=f: f(x)) for name, f in cands.items()]
            for name, fn in entries:
                ms, med = time_ms(fn, args.reps)
                row = {
                    "shape": shape_name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "kernel": name,
                    "ms": round(ms, 4),
                    "median_ms": round(med, 4),
                    "bf16_ms": round(bf16_ms, 4),
                    "bf16_median_ms": round(bf16_med, 4),
                    "fp32_ms": round(fp32_ms, 4),
                    "fp32_median_ms": round(fp32_med, 4),
                    "speedup_vs_bf16": round(bf16_ms / ms, 2),
                    "speedup_vs_fp32": round(fp32_ms / ms, 2),
                }
                rows.append(row)
                ratios = f"x{bf16_ms / ms:6.2f} vs bf16  x{fp32_ms / ms:6.2f} vs fp32"
                print(f"  {name:40s} {ms:8.3f} ({med:.3f}) ms  {ratios}")
    env["loadavg_end"] = os.getloadavg()
    for row in rows:
        if row["kernel"] == "cpu_int4 sym g64" and row["shape"] == "2048x2048" and row["m"] == 1:
            print(
                f"\nint4 vs bf16 matmul at M=1 on 2048x2048: x{row['speedup_vs_bf16']} "
                f"(the issue reported x17; fp32 matmul: x{row['speedup_vs_fp32']})"
            )
    out = Path(__file__).resolve().parent / "results" / "cpu_kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
