#!/usr/bin/env bash
# CMake flags for building llama.cpp (llama-cpp-python) for bench/runtime.py on this machine: the x86
# SIMD extensions /proc/cpuinfo lists, never AMX. Some VMs advertise AMX without granting it (llama.cpp's
# AMX code then dies with a general protection fault), and -march=native would pick it up; a flag the CPU
# lacks (e.g. AVX-VNNI on AMD Zen 4, which has only AVX512-VNNI) kills it with SIGILL.
# KILN_CPU_ISA=avx2 (Kiln's own cap, kernels/cpu_features.py) builds it as an AVX2-only CPU would run it:
# no AVX-512 and no VNNI of any width, so both sides of an AVX2 comparison run the same instructions.
set -euo pipefail
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
if [[ "${KILN_CPU_ISA:-auto}" == "avx2" ]]; then
  flags="$(tr ' ' '\n' <<<"$flags" | grep -v -E '^(avx512|avx_vnni|amx)' | tr '\n' ' ')"
  flags=" $flags "
fi
has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }
echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)" \
  "-DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)" \
  "-DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX_VNNI=$(has avx_vnni)" \
  "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
