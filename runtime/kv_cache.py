"""Preallocated per-slot KV cache, in the compute dtype ("auto") or in FP8 e4m3 ("fp8").

Layout, per layer (one tensor each for K and V, views into one allocation):

    (slots, kv_heads, max_len, head_dim)

Heads come before positions (unlike [.., max_len, kv_heads, ..]) so that one sequence's keys of one
head are contiguous and `cache[slot, :, :L]` is already the (kv_heads, L, head_dim) operand
`scaled_dot_product_attention` wants — no transpose copy on the decode hot path.

The memory comes from an anonymous mmap: zero-filled by the kernel and only resident once written,
so a large `max_model_len` costs address space, not RSS, and unwritten positions are finite (0),
which keeps masked attention exact (0 * garbage could be NaN).

FP8 ("fp8"): values are stored as float8_e4m3fn `x / scale` (saturated to ±448) and read back as
`stored * scale`; one K scale and one V scale per layer. The scales are chosen once at load by
`calibrate`: a forward pass over a fixed short English text records each layer's max |K| and |V|
(after RoPE) and sets `scale = CALIBRATION_HEADROOM * amax / 448`, leaving 2x headroom for prompts
with larger activations (e4m3 keeps ≈3 significant bits at every magnitude, so headroom costs
little precision; values beyond it saturate). Storage is 1 byte per element: half of bf16, a
quarter of fp32.

Keys only (`values=False`): multi-head latent attention caches one entry per token, `[latent |
rope key]`, as a single "head" of keys (runtime/mla.py); there are no value tensors.
"""

from __future__ import annotations

import mmap
from typing import Literal

import torch

from kernels.errors import KilnError

KvCacheDtype = Literal["auto", "fp8"]
E4M3_MAX = 448.0
CALIBRATION_HEADROOM = 2.0
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In the beginning of the twentieth century, "
    "scientists in many countries studied the structure of the atom, the nature of light and the "
    "origin of the stars; their questions, answers and arguments still shape how we think today."
)


class KvCacheError(KilnError):
    """Unsupported KV cache configuration."""


def _zeroed(nbytes: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    mm = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype), mm


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: KvCacheDtype = "auto",
        device: str | torch.device = "cpu",
        values: bool = True,
    ) -> None:
        if kv_cache_dtype not in ("auto", "fp8"):
            raise KvCacheError(f"--kv-cache-dtype must be auto or fp8, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.compute_dtype = dtype
        self.fp8 = kv_cache_dtype == "fp8"
        self.storage_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        self.num_slots = num_slots
        self.max_len = max_len
        kinds = 2 if values else 1
        shape = (kinds, num_layers, num_slots, num_kv_heads, max_len, head_dim)
        numel = kinds * num_layers * num_slots * num_kv_heads * max_len * head_dim
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        self._mapping: mmap.mmap | None = None
        if torch.device(device).type == "cpu":
            flat, self._mapping = _zeroed(numel * itemsize, self.storage_dtype)
            data = flat.view(shape)
        else:
            data = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        self.data = data
        self.k = list(data[0].unbind(0))  # per layer (slots, kv_heads, max_len, head_dim)
        self.v = list(data[1].unbind(0)) if values else []
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self._observe: list[list[float]] | None = None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.fp8:
            return x.to(self.storage_dtype)  # decode hands k in the rope dtype (fp32 on CPU)
        return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    def _load(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.fp8:
            return x
        return x.to(self.compute_dtype).mul_(scale)

    def _record(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        if self._observe is not None:
            obs = self._observe[layer]
            obs[0] = max(obs[0], float(k.abs().max()))
            if v is not None:
                obs[1] = max(obs[1], float(v.abs().max()))

    def write_prefill(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k, v: (kv_heads, T, head_dim) for positions [0, T) of `slot` (no v in a keys-only cache)."""
        self._record(layer, k, v)
        t = k.shape[1]
        self.k[layer][slot, :, :t] = self._store(k, self.k_scale[layer])
        if v is not None:
            self.v[layer][slot, :, :t] = self._store(v, self.v_scale[layer])

    def write_decode(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
    ) -> None:
        """k, v: (B, kv_heads, head_dim), one new position per sequence."""
        self._record(layer, k, v)
        self.k[layer][slots, :, positions] = self._store(k, self.k_scale[layer])
        if v is not None:
            self.v[layer][slots, :, positions] = self._store(v, self.v_scale[layer])

    def write_decode_one(
        self, layer: int, slot: int, position: int, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """k, v: (kv_heads, head_dim), the new position of one sequence (batch-1 decode)."""
        self._record(layer, k, v)
        if self.fp8:
            self.k[layer][slot, :, position] = self._store(k, self.k_scale[layer])
            if v is not None:
                self.v[layer][slot, :, position] = self._store(v, self.v_scale[layer])
        else:  # copy_ rounds to the cache dtype itself
            self.k[layer][slot, :, position].copy_(k)
            if v is not None:
                self.v[layer][slot, :, position].copy_(v)

    def read_keys_as(
        self, layer: int, slots: slice | torch.Tensor, length: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """(B, kv_heads, length, head_dim) keys in `dtype` (a keys-only cache's whole entries)."""
        return self._load(self.k[layer][slots, :, :length], self.k_scale[layer]).to(dtype)

    def read(self, layer: int, slots: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, kv_heads, length, head_dim) keys and values in the compute dtype."""
        k = self.k[layer][slots, :, :length]
        v = self.v[layer][slots, :, :length]
        return self._load(k, self.k_scale[layer]), self._load(v, self.v_scale[layer])

    def read_as(
        self, layer: int, slots: slice | torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` converted to `dtype`: (B, kv_heads, length, head_dim) keys and values. Without FP8,
        keys and values are converted together (one op on a (2, B, kv_heads, length, head_dim) view)."""
        if self.fp8:
            k, v = self.read(layer, slots, length)
            return k.to(dtype), v.to(dtype)
        kv = self.data[:, layer][:, slots, :, :length]  # (2, B, kv_heads, length, head_dim)
        k, v = kv.to(dtype).unbind(0)
        return k, v

    def begin_calibration(self) -> None:
        self._observe = [[0.0, 0.0] for _ in self.k]

    def end_calibration(self) -> None:
        """Set each layer's FP8 scales from the maxima seen since `begin_calibration`."""
        assert self._observe is not None, "end_calibration without begin_calibration"
        for layer, (k_max, v_max) in enumerate(self._observe):
            self.k_scale[layer] = max(k_max, 1e-6) * CALIBRATION_HEADROOM / E4M3_MAX
            self.v_scale[layer] = max(v_max, 1e-6) * CALIBRATION_HEADROOM / E4M3_MAX
        self._observe = None
