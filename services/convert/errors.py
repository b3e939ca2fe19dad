"""Conversion errors (KilnError family)."""

from __future__ import annotations

from kernels.errors import KilnError, UnsupportedError


class ConversionError(KilnError):
    """The checkpoint is malformed or inconsistent (missing tensors, wrong shapes, bad config)."""


class VerificationError(ConversionError):
    """A converted layer does not dequantize to the source weights within its documented bound."""


class Cancelled(KilnError):
    """The caller's should_cancel() returned True between layers; nothing was committed."""


__all__ = ["Cancelled", "ConversionError", "UnsupportedError", "VerificationError"]
