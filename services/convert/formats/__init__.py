"""Checkpoint formats: built-ins plus third-party ones from the `kiln.formats` entry-point group."""

from services.convert.formats.base import (
    DENSE,
    SUPPORTED_FORMATS_MESSAGE,
    CheckpointFormat,
    LayerQuant,
)

__all__ = ["DENSE", "SUPPORTED_FORMATS_MESSAGE", "CheckpointFormat", "LayerQuant"]
