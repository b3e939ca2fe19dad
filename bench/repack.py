"""Layout-prep throughput and peak memory on Llama-3-8B-shaped layers, against the naive reference.

    .venv/bin/python bench/repack.py [--reps 3] [--shapes 4096x4096,14336x4096,4096x14336]
        [--preps gptq_decode_4bit,...] [--threads N (default: torch's default)] [--no-single-thread]

For every prep (GPTQ decode, AWQ -> standard, Marlin repack 4/8-bit, scale / zero-point permutes, FP8
quantize per tensor / channel / block) and shape (N x K), a fresh subprocess builds the inputs,
resets the kernel's peak-RSS counter (write "5" to /proc/self/clear_refs, Linux >= 4.0; tracemalloc
cannot see torch's allocator), runs the prep once and reads VmHWM: "peak extra" = VmHWM - RSS before
the call, i.e. the memory the prep itself needed on top of its inputs. It then times `--reps` more
calls and keeps the best. Throughput is GB/s of SOURCE bytes (the checkpoint tensors the prep reads).

HEADLINE figure: the "GB/s [H]" column, wall-clock at torch's default intra-op thread count (what a
conversion uses; `--threads N` overrides). Each row is measured again with 1 thread ("1thr" columns,
`--no-single-thread` skips it). On a shared machine wall time includes waiting for a core, so the
GB/cpu-s columns (source bytes per second of process CPU time) are printed beside it.

The peer is the naive per-element implementation in tests/kernels/reference_layouts.py (Python loops),
timed in this process on a small slice of the same layer and EXTRAPOLATED linearly in source bytes to
the full layer; the ratio column is naive_extrapolated / ours. Results: bench/results/repack.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.base import IntWeight  # noqa: E402
from kernels.codecs import (  # noqa: E402
    awq_to_standard,
    decode_gptq,
    encode_awq,
    quantize_fp8,
    unpack_rows,
)
from kernels.marlin_layout import marlin_permute_scales, marlin_repack, marlin_zero_points  # noqa: E402
from tests.kernels import reference_layouts as ref  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K): qkv-ish, gate/up, down
GROUP = 128
TARGET_GBPS = 1.0
SMOKE_BYTES = 4 * 2**20  # rows with less source than this (e.g. 1024x1024) are labelled smoke, not counted

Inputs = dict[str, torch.Tensor]


def _words(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Random int32 words: every bit pattern is a valid packing of codes."""
    return torch.randint(-(2**31), 2**31, (rows, cols), generator=gen, dtype=torch.int32)


def _setup(prep: str, n: int, k: int, gen: torch.Generator) -> Inputs:
    g = k // GROUP
    if prep == "gptq_decode_4bit":
        return {
            "qweight": _words(gen, k // 8, n),
            "qzeros": torch.full((g, n // 8), 0x77777777, dtype=torch.int32),
            "scales": torch.rand(g, n, generator=gen).half(),
            "g_idx": (torch.arange(k) // GROUP).to(torch.int32),
        }
    if prep == "awq_to_standard":
        return {"qweight": _words(gen, k, n // 8), "qzeros": _words(gen, g, n // 8)}
    if prep == "marlin_repack_4bit":
        return {"qweight": _words(gen, k // 8, n)}
    if prep == "marlin_repack_8bit":
        return {"qweight": _words(gen, k // 4, n)}
    if prep == "marlin_permute_scales":
        return {"scales": torch.rand(g, n, generator=gen).half()}
    if prep == "marlin_zero_points_4bit":
        return {"zp": torch.randint(0, 16, (g, n), generator=gen, dtype=torch.uint8)}
    if prep.startswith("fp8_"):
        return {"w": (torch.randn(n, k, generator=gen) * 0.02).bfloat16()}
    raise ValueError(prep)


def _run(prep: str, x: Inputs, n: int, k: int) -> object:
    if prep == "gptq_decode_4bit":
        return decode_gptq(
            x["qweight"], x["qzeros"], x["scales"], x["g_idx"], bits=4, group_size=GROUP, sym=True, v2=False
        )
    if prep == "awq_to_standard":
        return awq_to_standard(x["qweight"], x["qzeros"])
    if prep == "marlin_repack_4bit":
        return marlin_repack(x["qweight"], 4)
    if prep == "marlin_repack_8bit":
        return marlin_repack(x["qweight"], 8)
    if prep == "marlin_permute_scales":
        return marlin_permute_scales(x["scales"], k, n, GROUP)
    if prep == "marlin_zero_points_4bit":
        return marlin_zero_points(x["zp"], 4)
    if prep == "fp8_tensor":
        return quantize_fp8(x["w"], "tensor")
    if prep == "fp8_channel":
        return quantize_fp8(x["w"], "channel")
    if prep == "fp8_block":
        return quantize_fp8(x["w"], "block")
    raise ValueError(prep)


PREPS = [
    "gptq_decode_4bit",
    "awq_to_standard",
    "marlin_repack_4bit",
    "marlin_repack_8bit",
    "marlin_permute_scales",
    "marlin_zero_points_4bit",
    "fp8_tensor",
    "fp8_channel",
    "fp8_block",
]


def _source_bytes(x: Inputs) -> int:
    return sum(t.numel() * t.element_size() for t in x.values())


# ---------------------------------------------------------------------------------------------
# worker: one prep, one shape, in its own process
# ---------------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(prep: str, n: int, k: int, reps: int, threads: int) -> dict[str, object]:
    if threads > 0:
        torch.set_num_threads(threads)
    x = _setup(prep, n, k, torch.Generator().manual_seed(0))
    rss_before = _status_kb("VmRSS")
    exact = _reset_peak()
    out = _run(prep, x, n, k)
    peak = _status_kb("VmHWM")
    del out
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        _run(prep, x, n, k)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    src = _source_bytes(x)
    return {
        "prep": prep,
        "n": n,
        "k": k,
        "threads": torch.get_num_threads(),
        "source_bytes": src,
        "seconds": min(wall),
        "cpu_seconds": min(cpu),
        "gbps": src / min(wall) / 1e9,
        "gbps_per_cpu_second": src / min(cpu) / 1e9,
        "peak_extra_mb": (peak - rss_before) / 1024,
        "peak_exact": exact,
    }


def _run_worker(prep: str, n: int, k: int, reps: int, threads: int) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--worker", prep, str(n), str(k), "--reps", str(reps)]
    cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# naive peer: per-element reference on a slice, extrapolated by source bytes
# ---------------------------------------------------------------------------------------------


def _naive_gptq_decode(x: Inputs) -> None:
    k = x["qweight"].shape[0] * 8
    codes = [ref.unpack_sequence(col, 4, k) for col in x["qweight"].T.tolist()]
    zeros = [
        [z + 1 for z in ref.unpack_sequence(row, 4, x["scales"].shape[1])] for row in x["qzeros"].tolist()
    ]
    assert all(z == 8 for row in zeros for z in row) and len(codes) == x["qweight"].shape[1]


def _naive_awq_to_standard(x: Inputs) -> None:
    inv = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack(words: torch.Tensor) -> torch.Tensor:
        rows = []
        for row in words.tolist():
            fields = ref.unpack_sequence(row, 4, len(row) * 8)
            rows.append([fields[8 * (c // 8) + inv[c % 8]] for c in range(len(fields))])
        return torch.tensor(rows)

    ref.ref_pack_rows(unpack(x["qweight"]), 4)
    ref.ref_pack_rows(unpack(x["qzeros"]).T, 4)


def _naive(prep: str, x: Inputs, k: int) -> None:
    if prep == "gptq_decode_4bit":
        _naive_gptq_decode(x)
    elif prep == "awq_to_standard":
        _naive_awq_to_standard(x)
    elif prep.startswith("marlin_repack"):
        bits = 4 if prep.endswith("4bit") else 8
        rows = x["qweight"].shape[0] * 32 // bits
        codes = torch.tensor([ref.unpack_sequence(col, bits, rows) for col in x["qweight"].T.tolist()]).T
        ref.ref_marlin_repack(codes, bits)
    elif prep == "marlin_permute_scales":
        ref.ref_permute_scales(x["scales"], k, GROUP)
    elif prep == "marlin_zero_points_4bit":
        ref.ref_marlin_zero_points(x["zp"], 4)
    elif prep == "fp8_tensor":
        ref.ref_fp8_per_tensor(x["w"], [x["w"].shape[0]])
    elif prep == "fp8_channel":
        ref.ref_fp8_per_channel(x["w"])
    elif prep == "fp8_block":
        ref.ref_fp8_per_block(x["w"], 128, 128)
    else:
        raise ValueError(prep)


def _slice(prep: str, n: int, k: int) -> tuple[int, int]:
    """(N, K) of the slice the naive reference runs on (whole tiles / groups / blocks)."""
    if prep == "fp8_block":
        return 256, 256
    if prep in ("fp8_tensor", "fp8_channel"):
        return 64, 128
    if prep in ("marlin_permute_scales", "marlin_zero_points_4bit"):
        return 256, 1024
    return 64, 256


def naive_seconds(prep: str, n: int, k: int, full_bytes: int) -> tuple[float, int, int]:
    sn, sk = _slice(prep, n, k)
    x = _setup(prep, sn, sk, torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    _naive(prep, x, sk)
    dt = time.perf_counter() - t0
    return dt * full_bytes / _source_bytes(x), sn, sk


# ---------------------------------------------------------------------------------------------


def _check_outputs_small() -> None:
    """Sanity: on a small layer the fast preps equal the naive ones (bit-exact)."""
    gen = torch.Generator().manual_seed(2)
    words = _words(gen, 32, 128)
    codes = unpack_rows(words, 4, 256)
    assert torch.equal(marlin_repack(words, 4), ref.ref_marlin_repack(codes, 4))
    w = IntWeight(codes.T.contiguous(), torch.rand(2, 128).half(), 4, 128, zeros=codes[:2].contiguous())
    a = encode_awq(w)
    std, _ = awq_to_standard(a["qweight"], a["qzeros"])
    assert torch.equal(std, ref.ref_pack_rows(codes, 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for the HEADLINE figure (default 0 = torch's default, what a "
        "conversion uses)",
    )
    ap.add_argument(
        "--no-single-thread",
        action="store_true",
        help="skip the second, 1-thread measurement of every row",
    )
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--preps", default=",".join(PREPS))
    ap.add_argument("--worker", nargs=3, metavar=("PREP", "N", "K"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "repack.json"))
    args = ap.parse_args()
    if args.worker:
        prep, n, k = args.worker
        print(json.dumps(worker(prep, int(n), int(k), args.reps, args.threads)))
        return

    _check_outputs_small()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows: list[dict[str, object]] = []
    header = (
        f"{'prep':<24}{'N x K':>12}{'src MB':>8}{'thr':>4}{'wall ms':>9}{'GB/s [H]':>9}{'GB/cpu-s':>9}"
        f"{'1thr GB/s':>10}{'1thr GB/cpu-s':>14}{'peak+MB':>8}{'naive s*':>10}{'ratio':>8}"
    )
    print(header)
    print("-" * len(header))
    for prep in args.preps.split(","):
        for n, k in shapes:
            row = _run_worker(prep, n, k, args.reps, args.threads)
            one = None if args.no_single_thread else _run_worker(prep, n, k, args.reps, 1)
            naive, sn, sk = naive_seconds(prep, n, k, int(row["source_bytes"]))
            smoke = int(row["source_bytes"]) < SMOKE_BYTES
            row.update(
                naive_extrapolated_seconds=naive,
                naive_slice=[sn, sk],
                ratio=naive / float(row["seconds"]),
                smoke=smoke,
                single_thread=one,
            )
            rows.append(row)
            one_cols = (
                f"{'-':>10}{'-':>14}"
                if one is None
                else f"{float(one['gbps']):>10.2f}{float(one['gbps_per_cpu_second']):>14.2f}"
            )
            print(
                f"{prep:<24}{f'{n}x{k}':>12}{int(row['source_bytes']) / 1e6:>8.1f}{int(row['threads']):>4}"
                f"{float(row['seconds']) * 1e3:>9.1f}{float(row['gbps']):>9.2f}"
                f"{float(row['gbps_per_cpu_second']):>9.2f}{one_cols}"
                f"{float(row['peak_extra_mb']):>8.0f}{naive:>10.1f}{row['ratio']:>7.0f}x"
                + ("  (< 4 MB source: noise-dominated, not counted)" if smoke else ""),
                flush=True,
            )
    print(
        "[H] HEADLINE: GB/s = source bytes / best wall time over --reps, at torch's default thread count\n"
        "    (thr column; what a conversion uses). The machine may be shared: compare GB/cpu-s too.\n"
        "GB/cpu-s = source bytes / best process CPU time (all threads; load-independent-ish);\n"
        "1thr = the same prep with torch.set_num_threads(1); peak+MB = VmHWM rise during one call;\n"
        "* naive = per-element reference (tests/kernels/reference_layouts.py) timed on a small slice and\n"
        "  extrapolated linearly in source bytes (fp8_block's reference loops over blocks, not elements);\n"
        "  ratio = naive / ours (headline wall)"
    )
    timed = [r for r in rows if not r["smoke"]]
    below = [r for r in timed if float(r["gbps"]) < TARGET_GBPS]
    below_cpu = [r for r in timed if float(r["gbps_per_cpu_second"]) < TARGET_GBPS]
    print(
        f"target >= {TARGET_GBPS} GB/s of source bytes: {len(timed) - len(below)}/{len(timed)} rows meet it "
        f"on the headline (wall), {len(timed) - len(below_cpu)}/{len(timed)} per CPU-second"
    )
    print(f"load average during the run: {os.getloadavg()} on {os.cpu_count()} CPUs")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "headline": "gbps: source bytes / best wall seconds at `threads` torch threads",
        "threads": args.threads or torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "reps": args.reps,
        "group_size": GROUP,
        "target_gbps": TARGET_GBPS,
        "peak_method": "VmHWM after clear_refs=5, minus VmRSS before the call",
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
