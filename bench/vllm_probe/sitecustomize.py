"""Measurement probe for bench/vllm_load.py, on PYTHONPATH of the vLLM processes it starts (never
installed): times each model runner's `load_model` (weights read + vLLM's processing, or Kiln's
binding) and records the process's memory around it as JSON lines in $KILN_BENCH_PROBE."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time
from typing import Any

RUNNERS = {
    "vllm.v1.worker.cpu_model_runner": "CPUModelRunner",
    "vllm.v1.worker.gpu_model_runner": "GPUModelRunner",
}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _wrap(cls: Any) -> None:
    original = cls.load_model
    if getattr(original, "_kiln_probe", False):
        return

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        rss_before = _status_kb("VmRSS")
        t = time.perf_counter()
        out = original(self, *args, **kwargs)
        record = {
            "pid": os.getpid(),
            "runner": cls.__name__,
            "load_seconds": time.perf_counter() - t,
            "rss_before_kb": rss_before,
            "rss_after_kb": _status_kb("VmRSS"),
            "hwm_after_kb": _status_kb("VmHWM"),
        }
        with open(os.environ["KILN_BENCH_PROBE"], "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    load_model._kiln_probe = True  # type: ignore[attr-defined]
    cls.load_model = load_model


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in RUNNERS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            _wrap(getattr(module, RUNNERS[name]))

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


if os.environ.get("KILN_BENCH_PROBE"):
    sys.meta_path.insert(0, _Finder())
