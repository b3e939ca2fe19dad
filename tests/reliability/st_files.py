"""Hand-built safetensors files (valid and broken) for the reliability tests and fuzzers."""

from __future__ import annotations

import json
import struct
from typing import Any

# Two tensors as a real checkpoint would hold them: (dtype, shape, bytes).
VALID_TENSORS: dict[str, tuple[str, list[int], bytes]] = {
    "model.embed_tokens.weight": ("F32", [2, 2], bytes(range(16))),
    "model.norm.weight": ("F16", [4], bytes(range(100, 108))),
}


def build(header: dict[str, Any] | bytes, data: bytes, *, header_len: int | None = None) -> bytes:
    """8-byte length + header (a dict is JSON-encoded) + data; `header_len` overrides the length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def valid_header() -> tuple[dict[str, Any], bytes]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (dtype, shape, blob) in VALID_TENSORS.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    return header, data


def valid_file() -> bytes:
    return build(*valid_header())
