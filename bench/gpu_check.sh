#!/usr/bin/env bash
# One prepared GPU check for a CUDA machine (target < 12 min; each part has a timeout): the Triton kernels compiled for this
# GPU, checked against their torch twins (pytest -m gpu), then timed against cuBLAS bf16
# (bench/gpu_check.py: table on stdout, JSON in bench/results/gpu_check.json), then the vLLM path when
# a CUDA vLLM 0.32 is importable ($VLLM_PYTHON, default: $PY): vLLM on a synthetic ≥ 1 GB 4096-wide
# GPTQ checkpoint vs `--load-format kiln` on its artifact for this GPU (bench/vllm_load.py: load
# time, startup, peak RSS, batch-1 tok/s, identical greedy tokens; bench/results/vllm_load.json).
# Needs: python3 with a CUDA build of torch and triton 3.x already installed (nothing else is
# installed here beyond `pip install -e .` of this repo when `kiln` is not importable).
# Usage: bash bench/gpu_check.sh            (PYTHON=/path/to/python to pick an interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
export TRITON_INTERPRET=0   # compile for the GPU (tests/conftest.py would default to the interpreter)

"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (torch %s, cuda %s)" % (torch.__version__, torch.version.cuda))
import triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "device", torch.cuda.get_device_name(), "sm%d%d" % torch.cuda.get_device_capability())
PYEOF

if ! "$PY" -c 'import kernels.registry' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps -e .
fi

status=0
echo "== correctness on CUDA (pytest -m gpu)"
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gpu_kernels_cuda.py || status=1

echo "== timing vs torch bf16 (cuBLAS)"
timeout 330 "$PY" bench/gpu_check.py || status=1

VPY="${VLLM_PYTHON:-$PY}"
if "$VPY" -c 'import vllm' 2>/dev/null; then
  "$VPY" -c 'import runtime.vllm_plugin' 2>/dev/null || "$VPY" -m pip install -q --no-deps -e .
  echo "== vLLM: GPTQ checkpoint vs its Kiln artifact (--load-format kiln), eager"
  timeout 300 "$PY" bench/vllm_load.py --vllm-python "$(command -v "$VPY")" --target auto --modes eager \
    --skip-smollm2 --big-gb 1.0 || status=1
else
  echo "== vLLM not importable by $VPY: vLLM path skipped (set VLLM_PYTHON)"
fi

exit $status
