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
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kernels.codecs.gguf import dequantize_gguf, ggml_type_name, unpermute_qk_rows
from kernels.errors import UnsupportedError
from services.convert.checkpoint import Checkpoint
from services.convert.gguf.container import GgufFile, GgufTensor, open_gguf
from services.convert.gguf.metadata import hf_config, hf_tensor_name, needs_qk_unpermute, tokenizer_files
from services.convert.limits import check_dimensions
from services.convert.safetensors_io import TensorInfo
from services.storage.base import SourceReader

log = logging.getLogger(__name__)

FLOAT_TYPES = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}
PLAIN_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# Linear-layer weights (kept as raw blocks for the format to decode): every other tensor is plain.
LAYER_WEIGHT_SUFFIXES = ("_proj.weight", "lm_head.weight", ".gate.weight")
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
        """A quantized linear-layer weight, read as its raw GGUF blocks."""
        return self.ggml_types[name] not in FLOAT_TYPES and name.endswith(LAYER_WEIGHT_SUFFIXES)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {name: self._read_tensor(name) for name in names}

    def _read_tensor(self, name: str) -> torch.Tensor:
        info = self.info(name)
        data = bytearray(self.source.read_range(info.file, info.start, info.end))
        kind = self.ggml_types[name]
        if kind in FLOAT_TYPES:
            t = torch.frombuffer(data, dtype=FLOAT_TYPES[kind][1]).reshape(self.shapes[name])
        else:
            t = torch.frombuffer(data, dtype=torch.uint8).reshape(*self.shapes[name][:-1], -1)
        if name in self.qk_heads:
            t = unpermute_qk_rows(t, self.qk_heads[name])
        if kind in FLOAT_TYPES or self.is_raw(name):
            return t
        k = self.shapes[name][-1]
        return (
            dequantize_gguf(t.reshape(-1, t.shape[-1]), kind, k, name)
            .reshape(self.shapes[name])
            .to(self.plain_dtype)
        )

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
        if not hf.endswith((".weight", ".bias")):
            raise UnsupportedError(
                f"{source.uri}/{name}: {tensor.name} stacks every expert of a layer; GGUF files with "
                "mixture-of-experts layers are not converted yet — convert the model's Hugging Face "
                "checkpoint instead"
            )
        _index(ckpt, gguf, tensor, hf)
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


def _index(ckpt: GgufCheckpoint, gguf: GgufFile, tensor: GgufTensor, hf: str) -> None:
    kind = tensor.ggml_type
    ckpt.ggml_types[hf] = kind
    ckpt.shapes[hf] = tuple(tensor.shape)
    raw_layer = kind not in FLOAT_TYPES and hf.endswith(LAYER_WEIGHT_SUFFIXES)
    if kind in FLOAT_TYPES:
        dtype = FLOAT_TYPES[kind][0]
    else:
        dtype = "U8" if raw_layer else PLAIN_DTYPE_NAMES[ckpt.plain_dtype]
    rows = math.prod(tensor.shape[:-1])
    shape = (*tensor.shape[:-1], tensor.nbytes // rows) if raw_layer else tuple(tensor.shape)  # raw: K bytes
    ckpt.tensors[hf] = TensorInfo(hf, ckpt.gguf_name, dtype, shape, tensor.start, tensor.end)
    arch = str(gguf.metadata.get("general.architecture", ""))
    qk = (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
    )
    if needs_qk_unpermute(arch) and hf.endswith(qk):
        heads_key = "num_attention_heads" if ".q_proj." in hf else "num_key_value_heads"
        ckpt.qk_heads[hf] = int(ckpt.config[heads_key])
