#!/usr/bin/env bash
# One prepared GPU check for a CUDA machine (≈ 8 min; each part has a timeout):
#   1. every Triton kernel compiled for this GPU against its torch twin, and the decode step captured
#      in CUDA graphs against the eager one (pytest -m gpu);
#   2. the runtime end to end on the GPU: the artifacts `python bench/gpu_serve.py prepare` built on a
#      CPU machine (.cache/gpu-cells: dense, GPTQ, FP8, W8A8, NVFP4, MXFP4, MoE) loaded on cuda, their
#      logits (prefill, batched and single decode, FP8 KV cache) against transformers in fp32
#      (bench/gpu_serve.py check; bench/results/gpu_serve.json);
#   3. the decode kernels timed against cuBLAS bf16, with the goals and the host cost per layer call
#      (bench/gpu_check.py; bench/results/gpu_check.json);
#   4. tile_wna16's launch-config sweep (bench/results/gpu_sweep.json; winners as table entries);
#   5. a 1 B Llama end to end: GPTQ int4 in Kiln's layout vs bf16 through the engine's CUDA graphs,
#      and bf16 against torch.compile (bench/gpu_decode.py; bench/results/gpu_decode.json);
#   6. with $VLLM_PYTHON naming a CUDA vLLM 0.32: vLLM on a synthetic ≥ 1 GB GPTQ checkpoint vs
#      `--load-format kiln` on its artifact (bench/vllm_load.py).
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
# Parts and their time limits (≈ 8 min in all, machine start aside): a part over its limit is cut
# and counted as a failure; the rest still run.
echo "== 1. kernels on CUDA against their twins; the captured decode step (pytest -m gpu)"
timeout 110 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gpu_kernels_cuda.py \
  tests/runtime/test_cuda_graph_decode.py || status=1

echo "== 2. artifacts served by the runtime on CUDA vs transformers fp32 (bench/gpu_serve.py)"
if [ -d .cache/gpu-cells ]; then
  timeout 80 "$PY" bench/gpu_serve.py check || status=1
else
  echo "no .cache/gpu-cells: run \`python bench/gpu_serve.py prepare\` on a CPU machine and carry it"
fi

echo "== 3. timing vs torch bf16 (cuBLAS): W4A16 tile / marlin, FP8 W8A8, FP4; host cost per call"
timeout 130 "$PY" bench/gpu_check.py --skip-moe --only "tile W4A16 g128" "marlin W4A16 g128" \
  "fp8_w8a8 channel (triton)" "marlin_fp4" || status=1

echo "== 4. launch-config sweep of tile_wna16 (winners printed as kernels/launch_table.py entries)"
timeout 60 "$PY" bench/gpu_check.py --sweep --sweep-kernels tile_wna16 || status=1

echo "== 5. end to end: a 1 B Llama, GPTQ int4 (--gpu-layout kiln) vs bf16, kiln serve's engine"
timeout 120 "$PY" bench/gpu_decode.py --layers 16 --tokens 64 --rounds 1 --marlin || status=1

VPY="${VLLM_PYTHON:-}"
if [ -n "$VPY" ] && "$VPY" -c 'import vllm' 2>/dev/null; then
  "$VPY" -c 'import runtime.vllm_plugin' 2>/dev/null || "$VPY" -m pip install -q --no-deps -e .
  echo "== 6. vLLM: GPTQ checkpoint vs its Kiln artifact (--load-format kiln), eager"
  timeout 300 "$PY" bench/vllm_load.py --vllm-python "$(command -v "$VPY")" --target auto --modes eager \
    --skip-smollm2 --big-gb 1.0 || status=1
else
  echo "== 6. vLLM path skipped (set VLLM_PYTHON to a CUDA vLLM 0.32 to run it: +5 min)"
fi

if [ -n "${OUT:-}" ]; then
  cp bench/results/gpu_check.json bench/results/gpu_serve.json bench/results/gpu_sweep.json \
    bench/results/gpu_decode.json "$OUT"/ 2>/dev/null
fi
exit $status
