"""vLLM's offline engine (`vllm.LLM`) as a long-lived host for many loads: run in the vLLM venv, it
reads one JSON job per line on stdin, builds an `LLM` for it in this process, scores the prompt,
tears the engine down and writes one JSON result per line on the stdout it started with (vLLM's own
logging goes to stderr). Imports only vLLM and the standard library.

A job: {"id", "model", "load_format": "kiln" | "auto", "dtype", "quantization"?, "hf_overrides"?,
"prompt_token_ids", "max_tokens", "resolve_only"?}. A result: {"id", "ok", "dtype" (vLLM's resolved
model dtype), "prompt_logprobs" (of every prompt token after the first), "output_token_ids",
"output_logprobs", "report" (the kiln loader's load report, for load_format kiln), "seconds"} or
{"id", "ok": false, "error"}. `resolve_only` answers with the dtype vLLM resolves, without loading.

Start-up is paid once (≈6 s of imports); a tiny model then loads, answers and is torn down in
≈0.3-0.5 s, once three per-engine costs that a server pays once per process are paid once here too:
vLLM calls `gc.collect()` several times per engine start and shutdown (≈0.25 s each on a heap this
size: the host freezes the heap after its imports and collects every COLLECT_EVERY jobs instead),
re-registers its C++ overrides of Triton kernels by walking every loaded module (≈0.35 s: done for
the first engine only), and sizes the CPU KV cache from VLLM_CPU_KVCACHE_SPACE in whole GiB, zeroed
per engine (dropped: KV_CACHE_BYTES applies).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

COLLECT_EVERY = 8
MAX_MODEL_LEN = 256
KV_CACHE_BYTES = 32 << 20


def _open_results() -> Any:
    """The original stdout, for results only; fd 1 then points at stderr (vLLM and C++ logs)."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def _engine_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": job["model"],
        "load_format": job.get("load_format", "kiln"),
        "dtype": job.get("dtype", "auto"),
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 2,
        "max_num_batched_tokens": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    if job.get("quantization"):
        kwargs["quantization"] = job["quantization"]
    if job.get("hf_overrides"):
        kwargs["hf_overrides"] = job["hf_overrides"]
    return kwargs


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _resolve(job: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs

    kwargs = _engine_kwargs(job)
    kwargs.pop("kv_cache_memory_bytes")
    config = EngineArgs(**kwargs).create_model_config()
    return {"dtype": _dtype_name(config.dtype), "head_dtype": _dtype_name(config.head_dtype)}


def _run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        os.environ["KILN_VLLM_LOAD_REPORT"] = str(report_path)
        llm = None
        try:
            llm = LLM(**_engine_kwargs(job))
            config = llm.llm_engine.model_config
            params = SamplingParams(
                max_tokens=int(job.get("max_tokens", 4)), temperature=0.0, logprobs=0, prompt_logprobs=0,
                detokenize=False,
            )  # fmt: skip
            [out] = llm.generate([{"prompt_token_ids": job["prompt_token_ids"]}], params, use_tqdm=False)
            prompt = [next(iter(d.values())).logprob for d in (out.prompt_logprobs or [])[1:]]
            completion = out.outputs[0]
            chosen = [
                lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs or [], strict=True)
            ]
            return {
                "dtype": _dtype_name(config.dtype),
                "head_dtype": _dtype_name(config.head_dtype),
                "prompt_logprobs": prompt,
                "output_token_ids": list(completion.token_ids),
                "output_logprobs": chosen,
                "report": json.loads(report_path.read_text()) if report_path.is_file() else None,
            }
        finally:
            os.environ.pop("KILN_VLLM_LOAD_REPORT", None)
            del llm
            _teardown()


def _teardown() -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def _register_triton_overrides_once() -> None:
    from vllm.platforms.cpu import CpuPlatform

    register = CpuPlatform.register_triton_kernel_overrides
    done = False

    def once(_cls: type) -> None:
        nonlocal done
        if not done:
            register()
            done = True

    CpuPlatform.register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign,assignment]


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    results = _open_results()
    import vllm  # noqa: F401  (imported once, before the heap is frozen)

    _register_triton_overrides_once()

    collect = gc.collect
    collect()
    gc.freeze()
    gc.collect = lambda generation=2: 0  # type: ignore[assignment,misc]
    results.write(json.dumps({"ready": True}) + "\n")
    for n, line in enumerate(sys.stdin, start=1):
        job = json.loads(line)
        started = time.perf_counter()
        try:
            result = {"ok": True, **(_resolve(job) if job.get("resolve_only") else _run(job))}
        except Exception as e:  # any failure of one job is its result; the host serves the next
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if not result["ok"] or n % COLLECT_EVERY == 0:
            # A half-built engine is reachable only through cycles: collected now, its finalizers
            # (which tear down vLLM's process groups) run before the next engine starts, not during it.
            collect()
            _teardown()
        result.update(id=job.get("id"), seconds=round(time.perf_counter() - started, 3))
        results.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
