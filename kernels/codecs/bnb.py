"""bitsandbytes checkpoint tensors <-> canonical weights, value for value with bitsandbytes' own
dequantization (`bitsandbytes.functional.dequantize_4bit` / `int8_vectorwise_dequant`).

4-bit (Params4bit, quant_type "nf4" or "fp4", as transformers saves it): `weight` holds the row-major
(N, K) codes two per byte, the first of each pair in the high nibble ((N*K/2, 1) uint8, or the same
bytes in a wider `bnb_4bit_quant_storage` dtype); every run of `blocksize` consecutive elements has
one absmax; w = quant_map[code] * absmax[block] in fp32. With double quantization the absmax are
bytes themselves: absmax = nested_quant_map[byte] * nested_absmax[block // nested_blocksize] +
nested_offset, each step in fp32 in this order (bitsandbytes' dequantize_blockwise, then the offset).
The quant_state tensor is a JSON document (quant_type, blocksize, shape, nested_offset, ...).

8-bit (Int8Params, LLM.int8): `weight` (N, K) int8 and `SCB` (N,) fp32 row absmax; w = q * SCB / 127.
The canonical weight is symmetric int8 channelwise, codes q + 128 and scales SCB / 127 (fp32): its
dequantization q * (SCB / 127) may differ from bitsandbytes' (q * SCB) / 127 by an fp32 rounding.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kernels.base import IntWeight
from kernels.errors import LayoutError

CODEBOOK_SIZE = 16
NESTED_MAP_SIZE = 256
INT8_CODE_BIAS = 128
INT8_MAX = 127.0


def quant_state(raw: torch.Tensor, name: str) -> dict[str, Any]:
    """The JSON document of a `...quant_state.bitsandbytes__<type>` tensor."""
    try:
        state = json.loads(bytes(raw.to(torch.uint8).reshape(-1).tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LayoutError(f"{name} is not a bitsandbytes quant_state JSON document ({e})") from e
    if not isinstance(state, dict):
        raise LayoutError(f"{name} holds {type(state).__name__}, not a quant_state object")
    return state


def decode_absmax(
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_quant_map: torch.Tensor | None,
    nested_blocksize: int,
    offset: float,
) -> torch.Tensor:
    """(blocks,) fp32 absmax: as stored, or decoded from double quantization in bitsandbytes' order."""
    if nested_absmax is None:
        return absmax.float()
    if nested_quant_map is None or nested_quant_map.numel() != NESTED_MAP_SIZE:
        raise LayoutError(f"double-quantized absmax needs a {NESTED_MAP_SIZE}-entry nested_quant_map")
    if absmax.dtype != torch.uint8:
        raise LayoutError(f"double-quantized absmax must be uint8, got {absmax.dtype}")
    blocks = absmax.numel()
    if nested_absmax.numel() != -(-blocks // nested_blocksize):
        raise LayoutError(
            f"{nested_absmax.numel()} nested absmax for {blocks} blocks of nested_blocksize "
            f"{nested_blocksize}"
        )
    scale = nested_absmax.float().repeat_interleave(nested_blocksize)[:blocks]
    return nested_quant_map.float()[absmax.long()] * scale + torch.tensor(offset, dtype=torch.float32)


def decode_bnb_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    state: dict[str, Any],
    *,
    nested_absmax: torch.Tensor | None = None,
    nested_quant_map: torch.Tensor | None = None,
) -> IntWeight:
    """One Params4bit weight as an IntWeight of 4-bit codes into `quant_map`, group = blocksize."""
    n, k = (int(d) for d in state["shape"])
    blocksize = int(state["blocksize"])
    if k % blocksize:
        raise LayoutError(
            f"K={k} is not a multiple of the bitsandbytes blocksize {blocksize}: its blocks span rows"
        )
    raw = packed.contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() != n * k // 2:
        raise LayoutError(f"packed weight holds {raw.numel()} bytes, shape {n}x{k} needs {n * k // 2}")
    if quant_map.numel() != CODEBOOK_SIZE:
        raise LayoutError(f"quant_map has {quant_map.numel()} entries, expected {CODEBOOK_SIZE}")
    blocks = n * k // blocksize
    if absmax.numel() != blocks:
        raise LayoutError(f"{absmax.numel()} absmax for {blocks} blocks of {blocksize}")
    scales = decode_absmax(
        absmax.reshape(-1),
        None if nested_absmax is None else nested_absmax.reshape(-1),
        nested_quant_map,
        int(state.get("nested_blocksize", NESTED_MAP_SIZE)),
        float(state.get("nested_offset", 0.0)),
    )
    codes = torch.stack((raw >> 4, raw & 15), dim=-1).reshape(n, k)  # high nibble first
    return IntWeight(
        codes=codes,
        scales=scales.reshape(n, k // blocksize).T.contiguous(),  # (G, N) fp32
        bits=4,
        group_size=blocksize,
        codebook=quant_map.float().reshape(-1).contiguous(),
    )


def decode_bnb_int8(weight: torch.Tensor, scb: torch.Tensor) -> IntWeight:
    """One Int8Params weight (row-major, `weight_format` 0) as symmetric int8 channelwise."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise LayoutError(f"8-bit weight must be 2-D int8, got {weight.dtype} {tuple(weight.shape)}")
    if scb.numel() != weight.shape[0]:
        raise LayoutError(f"SCB has {scb.numel()} values for {weight.shape[0]} rows")
    codes = (weight.to(torch.int16) + INT8_CODE_BIAS).to(torch.uint8)
    return IntWeight(codes=codes, scales=(scb.float() / INT8_MAX).reshape(1, -1), bits=8, group_size=-1)
