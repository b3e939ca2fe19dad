"""Conversion errors (KilnError family)."""

from __future__ import annotations

from kernels.errors import KilnError, LayoutError, UnsupportedError
from runtime.artifact.safetensors_header import SafetensorsFormatError


class ConversionError(KilnError):
    """The checkpoint is malformed or inconsistent (missing tensors, wrong shapes, bad config)."""


class NotACheckpointError(ConversionError):
    """The source exists but holds no Hugging Face checkpoint (no config.json)."""


class SourceSafetensorsError(ConversionError, SafetensorsFormatError):
    """A source checkpoint's safetensors file is malformed (both error families apply)."""


class QuantConfigError(ConversionError):
    """The quantization config is malformed: a field of the wrong type, missing or not allowed."""


class TensorLayoutError(ConversionError, LayoutError):
    """A layer's quantized tensors disagree with each other or with the quantization config."""


class VerificationError(ConversionError):
    """A converted layer does not dequantize to the source weights within its documented bound."""


class Cancelled(KilnError):
    """The caller's should_cancel() returned True between layers; nothing was committed."""


__all__ = [
    "Cancelled",
    "ConversionError",
    "QuantConfigError",
    "SafetensorsFormatError",
    "SourceSafetensorsError",
    "TensorLayoutError",
    "UnsupportedError",
    "VerificationError",
]
