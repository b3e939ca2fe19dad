"""The values a conversion request's options allow, without pydantic: `kiln`'s command line reads
them for its help text on every start (runtime commands included), and services/convert/spec.py
builds the request's model from them."""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["auto", "fp8"]  # keep the checkpoint's quantization | quantize to FP8 online
Fp8Scheme = Literal["tensor", "channel", "block"]  # online FP8 scales
HeadQuant = Literal["int8", "none"]  # --quantize-head: lm_head quantized online (cpu target), or not
METHODS: tuple[str, ...] = get_args(Method)
FP8_SCHEMES: tuple[str, ...] = get_args(Fp8Scheme)
HEAD_QUANTS: tuple[str, ...] = get_args(HeadQuant)
# --gpu-layout: GPU layers in the layouts vLLM's kernels read as they are (Marlin: served by kiln serve
# and by vLLM's plugin), or in Kiln's own layouts where one takes the layer (kiln serve's fastest)
GpuLayout = Literal["marlin", "kiln"]
GPU_LAYOUTS: tuple[str, ...] = get_args(GpuLayout)
KILN_GPU_LAYOUT = "kiln"
NO_HEAD_QUANT = "none"  # --quantize-head none: lm_head stays in the checkpoint's precision
