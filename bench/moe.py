"""Mixture-of-experts conversion and CPU serving, each against a peer measured in the same run.

    .venv/bin/python bench/moe.py [--vllm-python .venv-vllm/bin/python] [--layers 4] [--experts 32]
        [--tokens 64] [--threads 2] [--skip-decode] [--cells bf16 ...]

1. Conversion throughput, GB/s of the SOURCE checkpoint's bytes, on two synthetic Qwen3-MoE
   checkpoints (hidden 2048, E experts of I=768 top-4 in every layer, vocabulary 2048 so the experts
   are most of the bytes; devtools/builders/synthetic.py, cached under .cache/kiln-bench):
     gptq   GPTQ int4 g128 per-expert Linears -> sm80, marlin_moe_wna16 (the Marlin MoE layout)
     bf16   bf16 per-expert Linears -> sm90 with --method fp8 (per-tensor e4m3 per expert, fp8_moe_w8a8)
     nvfp4  compressed-tensors NVFP4 per-expert Linears -> sm80 (marlin_fp4_experts) and cpu
            (cpu_fp4_experts); no vLLM peer (its Marlin FP4 repack is the CUDA gptq_marlin_repack)
   Kiln runs `convert` end to end in a fresh process: read, decode, prepare, verify every expert
   against its source, write, hash. The peer is vLLM's own code (its CPU build, in its own venv) run
   on the same files the way vLLM's `process_weights_after_loading` does it: a layer's experts loaded
   into one stacked tensor, then a Python loop over experts — for gptq its reference Marlin packer
   (`marlin_utils_test.marlin_weights` per expert after `unpack_quantized_values_into_int32`, then
   `marlin_moe_permute_scales`; vLLM's GPU path calls the CUDA `gptq_marlin_moe_repack`, which the
   CPU build lacks), for bf16 `quant_utils.scaled_quantize` per expert with one scale per expert's
   w13 and w2 (the torch twin of the CUDA `scaled_fp8_quant` that vLLM 0.32's online per-tensor MoE
   method, `Fp8PerTensorOnlineMoEMethod`, loops over). The peer neither verifies nor writes anything, so the
   ratio understates Kiln's lead on equal work. The peer's Marlin bytes of the first MoE layer are
   compared with Kiln's artifact and must be identical.
2. Peak RSS of every process (VmHWM; devtools/process_memory.py) as a fraction of the source size,
   and against the streaming allowance: 0.5 x the source plus one expert group (one MoE layer's
   experts, in the source or as stored, whichever is more).
3. CPU decode tok/s at batch 1 and 8 of the tiny Qwen3-MoE of the tests (devtools/builders/moe.py:
   hidden 256, 8 experts top-2) served by Kiln (bf16 and GPTQ W4A16 artifacts),
   next to transformers on the same bf16 checkpoint (bf16 and fp32), each in its own process
   (bench/runtime.py's children).

Results: bench/results/moe.json. Figures of one run are comparable with each other only.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path and bench/runtime.py would shadow the
# `runtime` package: replace that entry with the repository root.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)
RESULTS = REPO / "bench" / "results" / "moe.json"
CACHE = REPO / ".cache" / "kiln-bench"
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
GROUP = 128
MARKER = "KILN-BENCH "


# --- children ------------------------------------------------------------------------------------


def child_kiln_convert(source: str, target: str, method: str, out: str) -> dict[str, Any]:
    from devtools.process_memory import current_rss_bytes, peak_rss_bytes
    from services.convert.library import ConversionRequest, convert

    base = current_rss_bytes()
    t0 = time.perf_counter()
    (result,) = convert(ConversionRequest(source, [target], method=method, out=out))
    seconds = time.perf_counter() - t0
    m = result.manifest
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "base_rss_bytes": base,
        "ok": m.verification.ok,
        "artifact": str(Path(out) / m.artifact_id),
        "expert_kernels": sorted({e.kernel for e in m.expert_groups.values()}),
    }


def _experts_of(source: Path) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(config, tensor -> file, MoE layer prefixes) of a Qwen3-MoE checkpoint."""
    config = json.loads((source / "config.json").read_text())
    index = source / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        with safe_open(str(source / "model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    layers = sorted(
        {name.split(".experts.")[0] for name in weight_map if ".experts." in name},
        key=lambda p: int(p.split(".")[2]),
    )
    return config, weight_map, layers


def child_vllm_peer(source_dir: str, mode: str, out: str) -> dict[str, Any]:
    """vLLM's own per-expert reference code over every MoE layer of `source_dir` (runs in vLLM's venv)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_moe_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_quantize,
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    from devtools.process_memory import peak_rss_bytes

    source = Path(source_dir)
    config, weight_map, layers = _experts_of(source)
    num_experts = config.get("num_experts") or config["num_local_experts"]
    handles: dict[str, Any] = {}

    def tensor(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in handles:
            handles[file] = safe_open(str(source / file), "pt")
        return handles[file].get_tensor(name)

    def stacked(layer: str, parts: tuple[str, ...], suffix: str, dim: int) -> torch.Tensor:
        """(E, ...) of every expert's parts concatenated along `dim` (vLLM's w13 / w2 parameters)."""
        return torch.stack(
            [
                torch.cat([tensor(f"{layer}.experts.{e}.{p}.{suffix}") for p in parts], dim=dim)
                for e in range(num_experts)
            ]
        )

    perm = get_weight_perm(4)
    first: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    for i, layer in enumerate(layers):
        results: dict[str, torch.Tensor] = {}
        for part, parts in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
            if mode == "gptq":
                qweight = stacked(layer, parts, "qweight", 1)  # (E, K / 8, N) int32
                scales = stacked(layer, parts, "scales", 1)  # (E, K / 128, N) fp16
                size_k, size_n = qweight.shape[1] * 8, qweight.shape[2]
                packed = torch.empty((num_experts, size_k // 16, size_n * 2), dtype=torch.int32)
                for e in range(num_experts):  # gptq_marlin_moe_repack's loop, in vLLM's reference code
                    codes = unpack_quantized_values_into_int32(qweight[e], scalar_types.uint4b8, packed_dim=0)
                    packed[e] = marlin_weights(codes, size_k, size_n, 4, perm)
                results[f"{part}.qweight"] = packed
                results[f"{part}.scales"] = marlin_moe_permute_scales(scales, size_k, size_n, GROUP)
            else:
                weight = stacked(layer, parts, "weight", 0)  # (E, N, K) bf16
                fp8 = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
                scale = torch.empty(num_experts, dtype=torch.float32)
                for e in range(num_experts):  # Fp8PerTensorOnlineMoEMethod's loop
                    fp8[e], s = scaled_quantize(weight[e], GroupShape.PER_TENSOR, torch.float8_e4m3fn)
                    scale[e] = s.reshape(())
                results[f"{part}.weight"] = fp8
                results[f"{part}.weight_scale"] = scale
        if i == 0:
            first = {k: v.contiguous() for k, v in results.items()}
    seconds = time.perf_counter() - t0
    if out:
        save_file(first, out)
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "layers": len(layers),
        "first_layer": layers[0],
    }


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(python: str, args: list[str], timeout: int = 3600) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [python, str(Path(__file__).resolve()), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {args[:2]} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(MARKER))


# --- the parent ----------------------------------------------------------------------------------


def source_checkpoints(layers: int, experts: int) -> dict[str, Path]:
    """{"gptq": ..., "bf16": ...}: the synthetic Qwen3-MoE checkpoints, written once per shape."""
    from devtools.builders.synthetic import TINY, Dims, write_checkpoint, write_large_checkpoint

    dims = Dims(
        architecture="Qwen3MoeForCausalLM", hidden=2048, heads=16, kv_heads=4, head_dim=128, vocab=2048,
        layers=layers, num_experts=experts, top_k=4, moe_intermediate=768, intermediate=TINY.intermediate,
    )  # fmt: skip
    out = {}
    for kind in ("gptq", "bf16", "nvfp4"):
        path = CACHE / f"qwen3-moe-h2048-l{layers}-e{experts}-i768-{kind}-v1"
        if not (path / "config.json").exists():
            print(f"  writing {path.name} ...", flush=True)
            tmp = path.with_name(path.name + ".partial")
            if kind == "gptq":
                write_checkpoint(tmp, "gptq", dims=dims, group_size=GROUP, sharded=True)
            elif kind == "nvfp4":
                write_checkpoint(tmp, "ct-nvfp4", dims=dims, sharded=True)
            else:
                write_large_checkpoint(tmp, dims)
            tmp.rename(path)
        out[kind] = path
    return out


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def expert_group_bytes(path: Path, prefix: str = "model.layers.0.mlp.experts.") -> int:
    """Bytes of one MoE layer's experts in a checkpoint."""
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith(prefix):
                    t = st.get_slice(name)
                    numel = 1
                    for d in t.get_shape():
                        numel *= d
                    total += numel * DTYPE_BYTES[t.get_dtype()]
    return total


DTYPE_BYTES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


def compare_marlin_bytes(artifact: Path, peer_file: Path, layer: str) -> dict[str, bool]:
    """Kiln's stacked Marlin tensors of `layer` against vLLM's: identical bytes (scales in Kiln's dtype)."""
    import torch
    from safetensors import safe_open

    same = {}
    with (
        safe_open(str(peer_file), "pt") as peer,
        safe_open(str(artifact / "rank0.safetensors"), "pt") as kiln,
    ):
        for name in peer.keys():  # noqa: SIM118 (safe_open has no __iter__)
            mine = kiln.get_tensor(f"{layer}.experts.{name}")
            theirs = peer.get_tensor(name).to(mine.dtype)
            same[name] = mine.shape == theirs.shape and torch.equal(mine, theirs)
    return same


def bench_conversion(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    sources = source_checkpoints(args.layers, args.experts)
    # cell -> (source kind, target, method)
    cells = {
        "gptq": ("gptq", "sm80", "auto"),
        "bf16": ("bf16", "sm90", "fp8"),
        "nvfp4": ("nvfp4", "sm80", "auto"),
        "nvfp4-cpu": ("nvfp4", "cpu", "auto"),
    }
    results: dict[str, Any] = {}
    for cell, (kind, target, method) in cells.items():
        if args.cells and cell not in args.cells:
            continue
        src = sources[kind]
        size = checkpoint_bytes(src)
        print(f"  {cell}: {src.name} ({size / 1e9:.2f} GB) -> {target} --method {method}", flush=True)
        kiln = run_child(
            sys.executable, ["--child", "kiln-convert", str(src), target, method, str(out_dir / cell)]
        )
        row: dict[str, Any] = {"source_bytes": size, "target": target, "method": method, "kiln": kiln}
        row["kiln"]["gb_per_s"] = size / kiln["seconds"] / 1e9
        group = max(
            expert_group_bytes(src), expert_group_bytes(Path(kiln["artifact"]), "model.layers.0.mlp.experts.")
        )
        row["rss_allowance_bytes"] = allowance = size // 2 + group
        row["within_allowance"] = kiln["peak_rss_bytes"] - kiln["base_rss_bytes"] <= allowance
        if kind == "nvfp4":  # no vLLM peer: its Marlin FP4 repack is the CUDA-only gptq_marlin_repack
            row["vllm_reference"] = "none: vLLM's Marlin FP4 repack is a CUDA op"
        elif args.vllm_python.exists():
            peer_file = out_dir / f"peer-{kind}.safetensors"
            peer = run_child(str(args.vllm_python), ["--child", "vllm-peer", str(src), kind, str(peer_file)])
            peer["gb_per_s"] = size / peer["seconds"] / 1e9
            row["vllm_reference"] = peer
            row["kiln_over_vllm_speed"] = peer["seconds"] / kiln["seconds"]
            if kind == "gptq":
                row["marlin_bytes_identical"] = compare_marlin_bytes(
                    Path(kiln["artifact"]), peer_file, peer["first_layer"]
                )
        else:
            row["vllm_reference"] = f"skipped: {args.vllm_python} missing (make vllm-venv)"
        results[cell] = row
    return results


def bench_decode(args: argparse.Namespace) -> dict[str, Any]:
    from devtools.builders import smollm2
    from devtools.builders.moe import build_quantized, build_qwen3_moe

    source = build_qwen3_moe("marlin")
    systems: dict[str, tuple[str, Path]] = {
        "kiln-bf16": ("kiln", smollm2.build_artifact(source, "cpu", method="auto")),
        "transformers-bf16": ("transformers-bfloat16", source),
        "transformers-fp32": ("transformers-float32", source),
    }
    try:
        gptq = build_quantized(source, "gptq-w4a16")
        systems["kiln-int4-gptq"] = ("kiln", smollm2.build_artifact(gptq, "cpu", method="auto"))
    except ImportError as e:
        print(f"  skip kiln-int4-gptq: {e}")
    runtime_bench = REPO / "bench" / "runtime.py"
    results: dict[str, Any] = {}
    for name, (child, path) in systems.items():
        print(f"  decode {name}: {path.name}", flush=True)
        cmd = [sys.executable, str(runtime_bench), "--child", child, "--path", str(path),
               "--tokens", str(args.tokens), "--threads", str(args.threads)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_NUM_THREADS": str(args.threads),
               "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        r = json.loads(lines[-1].removeprefix(MARKER))
        results[name] = {"decode_tok_s": r["decode_tok_s"], "peak_rss_mb": r["peak_rss_mb"]}
    return results


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict[str, Any]) -> None:
    print("\nConversion (GB/s of source; peak RSS as a fraction of the source size; kiln's peak - base")
    print("RSS against 0.5 x source + one expert group)")
    print(f"{'cell':9} {'target':12} {'kiln GB/s':>10} {'vLLM ref GB/s':>14} {'kiln/vLLM':>10} "
          f"{'kiln RSS':>9} {'vLLM RSS':>9} {'peak-base MB':>13} {'allowance MB':>13}")  # fmt: skip
    for kind, row in result["conversion"].items():
        size = row["source_bytes"]
        kiln = row["kiln"]
        peer = row["vllm_reference"] if isinstance(row["vllm_reference"], dict) else {}
        cells = [
            f"{kind:9} {row['target'] + ' ' + row['method']:12}",
            f"{kiln['gb_per_s']:10.3f}",
            f"{_fmt(peer.get('gb_per_s'), '.3f'):>14}",
            f"{_fmt(row.get('kiln_over_vllm_speed'), '.2f'):>9}x",
            f"{kiln['peak_rss_bytes'] / size:9.3f}",
            f"{_fmt(peer['peak_rss_bytes'] / size if peer else None, '.3f'):>9}",
            f"{(kiln['peak_rss_bytes'] - kiln['base_rss_bytes']) / 1e6:13.0f}",
            f"{row['rss_allowance_bytes'] / 1e6:13.0f}",
        ]
        print(" ".join(cells))
        if "marlin_bytes_identical" in row:
            print(f"       Marlin bytes identical to vLLM's (first layer): {row['marlin_bytes_identical']}")
    if "decode" in result:
        print("\nCPU decode tok/s, tiny Qwen3-MoE (batch 1 / batch 8)")
        base = result["decode"].get("transformers-bf16", {}).get("decode_tok_s", {})
        for name, r in result["decode"].items():
            tok = r["decode_tok_s"]
            ratio = " / ".join(f"{tok[b] / base[b]:.2f}x" for b in ("1", "8") if b in base)
            print(f"  {name:20} {tok['1']:8.1f} / {tok['8']:8.1f}   vs transformers-bf16 {ratio}"
                  f"   peak RSS {r['peak_rss_mb']:.0f} MB")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument(
        "--cells", nargs="+", help="conversion cells to run (gptq bf16 nvfp4 nvfp4-cpu); all by default"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        _emit(child_kiln_convert(*rest) if kind == "kiln-convert" else child_vllm_peer(*rest))
        return
    import tempfile

    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_before": os.getloadavg(),
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moe-", dir=CACHE) as tmp:
        result["conversion"] = bench_conversion(args, Path(tmp))
    if not args.skip_decode:
        result["decode"] = bench_decode(args)
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
