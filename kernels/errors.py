"""The error hierarchy shared by every Kiln layer.

Errors raised at a boundary say which layer / tensor / field is at fault and what to do about it.
`runtime` and `services` subclass these; nothing below `kernels` exists, so they live here.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base class of every error Kiln raises on purpose (bad input, unsupported combination, fault)."""


class UnsupportedError(KilnError):
    """Valid input that Kiln cannot (yet) handle; the message says what is supported."""


class NoKernelError(UnsupportedError):
    """No kernel in the target's priority list can implement a layer; lists every rejection reason."""

    def __init__(self, layer: str, target: str, rejections: list[tuple[str, str]]) -> None:
        self.layer = layer
        self.target = target
        self.rejections = rejections
        reasons = "; ".join(f"{name}: {reason}" for name, reason in rejections) or "no kernel registered"
        super().__init__(f"no kernel for layer {layer!r} on target {target}: {reasons}")


class LayoutError(KilnError):
    """Tensors do not have the shape / dtype / values their declared format requires."""
