"""The checkpoints and artifacts of the plugin's dtype matrix: source dtype × method, each a real
checkpoint of a tiny random Qwen3 / Qwen3-MoE / Mixtral (devtools/builders/moe.py), and
its CPU artifact.

    dense       the source itself                                  (vLLM: unquantized)
    fp8-online  the source, converted with --method fp8            (vLLM: --quantization fp8)
    gptq        llm-compressor GPTQ W4A16 g128 (compressed-tensors) (vLLM: compressed-tensors WNA16)
    awq         AWQ-GEMM (quant_method awq) packed by AutoAWQ's     (vLLM: awq)
                packer; scales fp16 as AutoAWQ stores them, every
                other tensor and config.json's dtype the source's
    w8a8        llm-compressor W8A8 int8 (dynamic per-token acts)  (vLLM: compressed-tensors W8A8)
    moe-gptq    llm-compressor GPTQ W4A16 of Qwen3-MoE              (vLLM: compressed-tensors MoE WNA16)
    moe-fp8     llm-compressor FP8_DYNAMIC of Mixtral               (vLLM: compressed-tensors MoE FP8)

A source saved in fp16 / fp32 holds the same seeded fp32 weights as the bf16 one, rounded to its
dtype, and quantized checkpoints keep their scales in it (as llm-compressor saves a model it loaded
in that dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from devtools.builders import moe, smollm2
from tests.fixtures.checkpoints import WEIGHT_ONLY

SOURCE_DTYPES = ("bfloat16", "float16", "float32")
METHODS = ("dense", "fp8-online", "gptq", "awq", "w8a8", "moe-gptq", "moe-fp8")
# vLLM --dtype values of the matrix ("auto" resolves to one of the others: vLLM's rule, checked).
VLLM_DTYPES = ("auto", "bfloat16", "float32")
AWQ_GROUP_SIZE = 128


@dataclass(frozen=True)
class Method:
    spec: str  # moe.SPECS name of the model
    scheme: str | None  # moe.SCHEMES name; None: the source as saved
    convert_method: str = "auto"  # kiln convert --method
    vllm_quantization: str | None = None  # what vLLM is asked for on the original checkpoint


METHOD_SPECS: dict[str, Method] = {
    "dense": Method("qwen3-dense", None),
    "fp8-online": Method("qwen3-dense", None, convert_method="fp8", vllm_quantization="fp8"),
    "gptq": Method("qwen3-dense", "gptq-w4a16"),
    "awq": Method("qwen3-dense", "awq-gemm"),
    "w8a8": Method("qwen3-dense", "w8a8-int8"),
    "moe-gptq": Method("qwen3-moe-marlin", "gptq-w4a16"),
    "moe-fp8": Method("mixtral", "fp8-dynamic"),
}


def source_checkpoint(method: str, dtype: str) -> Path:
    """The original checkpoint of a matrix cell (built once per cache)."""
    m = METHOD_SPECS[method]
    source = moe.build_source(m.spec, dtype=dtype)
    if m.scheme is None:
        return source
    if m.scheme == "awq-gemm":
        return smollm2._cached_build(
            f"{source.name}--awq-gemm-g{AWQ_GROUP_SIZE}-v1",
            None,
            lambda out: smollm2.write_awq_gemm(source, out, group_size=AWQ_GROUP_SIZE, dtype=None),
        )
    return moe.build_quantized(source, m.scheme)


def artifact(method: str, dtype: str) -> Path:
    """The CPU artifact of a matrix cell (converted once per cache), with vLLM's 16-bit head and
    activations: what the plugin serves."""
    return smollm2.build_artifact(
        source_checkpoint(method, dtype), "cpu", method=METHOD_SPECS[method].convert_method, **WEIGHT_ONLY
    )
