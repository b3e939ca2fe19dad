"""A GGUF file opened as a checkpoint: the same `Checkpoint` the converter reads safetensors through.

The header is parsed with ranged reads (container.py); the model config and the tokenizer files come
from the metadata (metadata.py); tensors are indexed under their Hugging Face names. A linear layer's
weight is handed to the GGUF format (formats/gguf.py) as its raw blocks — uint8 (N, K bytes), the
llama.cpp q/k row permutation undone on the bytes — and decoded there; every other tensor
(embeddings, norms) is read as a plain float tensor: float types as stored, quantized ones (a Q8_0
embedding) dequantized into the model's dtype. The artifact's source digest is the GGUF file's
sha256.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kernels.codecs.gguf import dequantize_gguf, ggml_type_name, gguf_row_bytes, unpermute_qk_rows
from services.convert.checkpoint import Checkpoint
from services.convert.gguf.container import GgufFile, GgufTensor, open_gguf
from services.convert.gguf.metadata import (
    expert_weight_name,
    hf_config,
    hf_tensor_name,
    needs_qk_unpermute,
    tokenizer_files,
)
from services.convert.limits import check_dimensions
from services.convert.safetensors_io import TensorInfo
from services.storage.base import SourceReader

log = logging.getLogger(__name__)

FLOAT_TYPES = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}
PLAIN_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# Read as float tensors even when quantized (dequantized): the embedding; 1-D tensors are always plain.
PLAIN_SUFFIXES = ("embed_tokens.weight",)
PLAIN_READ_BYTES = 1 << 20  # GGUF bytes of a plain quantized tensor read and dequantized at a time
ROPE_FACTORS = "rope_freqs.weight"
QK_TENSORS = tuple(f"self_attn.{p}_proj.{s}" for p in "qk" for s in ("weight", "bias"))  # llama.cpp permutes


@dataclass
class GgufCheckpoint(Checkpoint):
    gguf_name: str = ""
    ggml_types: dict[str, int] = field(default_factory=dict)  # HF name -> GGML type id
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # HF name -> (N, K) as decoded
    qk_heads: dict[str, int] = field(default_factory=dict)  # q/k weights to unpermute -> heads
    generated_files: dict[str, bytes] = field(default_factory=dict)  # tokenizer files from metadata
    plain_dtype: torch.dtype = torch.bfloat16  # what a quantized non-layer tensor is dequantized to

    @property
    def uri(self) -> str:
        return f"{self.source.uri.rstrip('/')}/{self.gguf_name}"

    def is_raw(self, name: str) -> bool:
        """A quantized layer weight (2-D, not the embedding), read as its raw GGUF blocks."""
        return is_raw(name, self.ggml_types[name], self.shapes[name])

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {name: self._read_tensor(name) for name in names}

    def _read_tensor(self, name: str) -> torch.Tensor:
        kind = self.ggml_types[name]
        if (made := self.row_blocks(name)) is not None:
            dtype, shape, blocks = made
            out = torch.empty(shape, dtype=dtype)
            row = 0
            for block in blocks:
                out[row : row + block.shape[0]] = block
                row += block.shape[0]
            return out
        data = self.read_raw(name)  # (bytes,) uint8
        if kind in FLOAT_TYPES:
            t = data.view(FLOAT_TYPES[kind][1]).reshape(self.shapes[name])
        else:
            t = data.reshape(*self.shapes[name][:-1], -1)
        if name in self.qk_heads:
            t = unpermute_qk_rows(t, self.qk_heads[name])
        if kind in FLOAT_TYPES or self.is_raw(name):
            return t
        k = self.shapes[name][-1]
        return dequantize_gguf(t.reshape(-1, t.shape[-1]), kind, k, name, self.plain_dtype).reshape(
            self.shapes[name]
        )

    def row_blocks(self, name: str) -> tuple[torch.dtype, tuple[int, ...], Iterator[torch.Tensor]] | None:
        """A quantized 2-D tensor kept as a plain one (the embedding), dequantized to `plain_dtype` a
        row block at a time: its GGUF blocks, a float32 copy or the whole result never in memory."""
        kind, shape = self.ggml_types[name], self.shapes[name]
        if kind in FLOAT_TYPES or self.is_raw(name) or len(shape) != 2 or name in self.qk_heads:
            return None
        return self.plain_dtype, shape, self._dequantized_rows(name, kind, shape[0], shape[1])

    def _dequantized_rows(self, name: str, kind: int, n: int, k: int) -> Iterator[torch.Tensor]:
        row_bytes = gguf_row_bytes(kind, k, name)
        step = max(1, PLAIN_READ_BYTES // row_bytes)
        buf = torch.empty(min(n, step) * row_bytes, dtype=torch.uint8)  # reused by every block
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            raw = self.read_raw(name, r0 * row_bytes, r1 * row_bytes, buf).view(r1 - r0, row_bytes)
            yield dequantize_gguf(raw, kind, k, name, self.plain_dtype)  # (r1 - r0, K)

    def present_side_files(self) -> list[str]:
        return sorted(self.generated_files)

    def side_file(self, name: str) -> bytes:
        return self.generated_files[name]

    def _compute_hashes(self) -> dict[str, str]:
        return {self.gguf_name: self._sha256(self.gguf_name)}

    def type_name(self, name: str) -> str:
        return ggml_type_name(self.ggml_types[name])


def open_gguf_checkpoint(source: SourceReader, name: str) -> GgufCheckpoint:
    gguf = open_gguf(source, name)
    config = hf_config(gguf.metadata, list(gguf.tensors), rope_factors=_rope_factors(source, name, gguf))
    ckpt = GgufCheckpoint(source=source, config=config, tensors={}, weight_files=[name], gguf_name=name)
    for tensor in gguf.tensors.values():
        hf = hf_tensor_name(tensor.name, config)
        if hf is None:
            continue
        if hf.endswith((".weight", ".bias")):
            _index(ckpt, gguf, tensor, hf, tensor.shape, tensor.start, tensor.end)
        else:  # every expert of a layer stacked (E, N, K): one tensor entry per expert
            experts, per = tensor.shape[0], tensor.nbytes // tensor.shape[0]
            for e in range(experts):
                start = tensor.start + e * per
                _index(ckpt, gguf, tensor, expert_weight_name(hf, e), tensor.shape[1:], start, start + per)
    ckpt.generated_files = tokenizer_files(gguf.metadata)
    check_dimensions(config, ckpt.tensors)
    log.info("opened %s/%s: GGUF v%d, %d tensors", source.uri, name, gguf.version, len(ckpt.tensors))
    return ckpt


def _rope_factors(source: SourceReader, name: str, gguf: GgufFile) -> list[float] | None:
    """Llama 3's rope scaling, which llama.cpp stores as a tensor of per-frequency factors."""
    tensor = gguf.tensors.get(ROPE_FACTORS)
    if tensor is None:
        return None
    raw = torch.frombuffer(bytearray(source.read_range(name, tensor.start, tensor.end)), dtype=torch.uint8)
    return dequantize_gguf(raw, tensor.ggml_type, tensor.shape[-1], ROPE_FACTORS).tolist()


def is_raw(name: str, ggml_type: int, shape: tuple[int, ...]) -> bool:
    return ggml_type not in FLOAT_TYPES and len(shape) == 2 and not name.endswith(PLAIN_SUFFIXES)


def _index(
    ckpt: GgufCheckpoint,
    gguf: GgufFile,
    tensor: GgufTensor,
    hf: str,
    shape: tuple[int, ...],
    start: int,
    end: int,
) -> None:
    kind = tensor.ggml_type
    ckpt.ggml_types[hf] = kind
    ckpt.shapes[hf] = tuple(shape)
    raw = is_raw(hf, kind, tuple(shape))
    if kind in FLOAT_TYPES:
        dtype = FLOAT_TYPES[kind][0]
    else:
        dtype = "U8" if raw else PLAIN_DTYPE_NAMES[ckpt.plain_dtype]
    stored = (*shape[:-1], (end - start) // math.prod(shape[:-1])) if raw else tuple(shape)  # raw: K bytes
    ckpt.tensors[hf] = TensorInfo(hf, ckpt.gguf_name, dtype, stored, start, end)
    arch = str(gguf.metadata.get("general.architecture", ""))
    if needs_qk_unpermute(arch) and hf.endswith(QK_TENSORS):
        heads_key = "num_attention_heads" if ".q_proj." in hf else "num_key_value_heads"
        ckpt.qk_heads[hf] = int(ckpt.config[heads_key])
