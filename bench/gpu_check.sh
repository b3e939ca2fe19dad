#!/usr/bin/env bash
# One prepared GPU check for a CUDA machine (≈ 8 min; each part has a timeout):
#   1. every Triton kernel compiled for this GPU against its torch twin (pytest -m gpu);
#   2. the runtime end to end on the GPU: the artifacts `python bench/gpu_serve.py prepare` built on a
#      CPU machine (.cache/gpu-cells: dense, GPTQ, FP8, W8A8, NVFP4, MXFP4, MoE) loaded on cuda, their
#      logits (prefill, batched and single decode, FP8 KV cache) against transformers in fp32
#      (bench/gpu_serve.py check; bench/results/gpu_serve.json);
#   3. each kernel timed against cuBLAS bf16 (bench/gpu_check.py; bench/results/gpu_check.json);
#   4. the vLLM path when a CUDA vLLM 0.32 is importable ($VLLM_PYTHON, default: $PY): vLLM on a
#      synthetic ≥ 1 GB GPTQ checkpoint vs `--load-format kiln` on its artifact (bench/vllm_load.py).
# Needs: python3 with a CUDA build of torch and triton 3.x. Wheels the runtime needs beyond those
# (pydantic, pydantic-settings, starlette) are installed from .whl/ when present and not importable.
# Results are copied to $OUT when it is set.
# Usage: bash bench/gpu_check.sh            (PYTHON=/path/to/python to pick an interpreter)
set -uo pipefail
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
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (torch %s, cuda %s)" % (torch.__version__, torch.version.cuda))
import triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "device", torch.cuda.get_device_name(), "sm%d%d" % torch.cuda.get_device_capability())
PYEOF

if ! "$PY" -c 'import pydantic_settings, starlette' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kiln-site .whl/*.whl
  export PYTHONPATH="/tmp/kiln-site${PYTHONPATH:+:$PYTHONPATH}"
fi

status=0
echo "== 1. kernels on CUDA against their twins (pytest -m gpu)"
timeout 170 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gpu_kernels_cuda.py || status=1

echo "== 2. artifacts served by the runtime on CUDA vs transformers fp32 (bench/gpu_serve.py)"
if [ -d .cache/gpu-cells ]; then
  timeout 150 "$PY" bench/gpu_serve.py check || status=1
else
  echo "no .cache/gpu-cells: run \`python bench/gpu_serve.py prepare\` on a CPU machine and carry it"
fi

echo "== 3. timing vs torch bf16 (cuBLAS)"
timeout 220 "$PY" bench/gpu_check.py || status=1

VPY="${VLLM_PYTHON:-$PY}"
if "$VPY" -c 'import vllm' 2>/dev/null; then
  "$VPY" -c 'import runtime.vllm_plugin' 2>/dev/null || "$VPY" -m pip install -q --no-deps -e .
  echo "== 4. vLLM: GPTQ checkpoint vs its Kiln artifact (--load-format kiln), eager"
  timeout 300 "$PY" bench/vllm_load.py --vllm-python "$(command -v "$VPY")" --target auto --modes eager \
    --skip-smollm2 --big-gb 1.0 || status=1
else
  echo "== 4. vLLM not importable by $VPY: vLLM path skipped (set VLLM_PYTHON)"
fi

if [ -n "${OUT:-}" ]; then
  cp bench/results/gpu_check.json bench/results/gpu_serve.json "$OUT"/ 2>/dev/null
fi
exit $status
