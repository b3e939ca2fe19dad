"""The native decode step: a whole decode step of a dense Llama-family model in one call
(runtime/native/decode_step.c), instead of ≈1,000 small torch ops dispatched from Python per token.

`native_decoder(model, cache)` describes the bound model to the library once — pointers to the
tensors the loader mapped, in the CPU kernels' own layouts (cpu_int4's torch pack, cpu_int8, cpu_w8a8,
dense, cpu_w4a8's integer-dot layout through that kernel's own bodies, kernels/native/w4a8_gemv.h) — and
returns a `NativeDecoder` whose `decode` has `LlamaForCausalLM.decode`'s signature and results
(the same rounding points; logits within accumulation-order differences, the LM head exact in fp32
where the eager one rounds all but its top logits to bf16). The eager forward stays the reference
and the fallback: for what the native step does not cover (MoE, MLA, windows, sinks, TP, act-order,
other kernels, GPUs) or without a C compiler, `native_decoder` returns None with the reason.

The library runs a pool of `threads` threads (torch's count) that spin `spin_us` microseconds
between steps — a decode loop's next step comes within that — and then sleep.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import cpu_features, cpu_w4a8
from kernels.base import ALL_ROWS
from kernels.native_build import NativeLibrary
from runtime.kv_cache import KVCache
from runtime.layers import KernelLinear
from runtime.model import MLP, Attention, LlamaForCausalLM

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "decode_step.c"
FLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-Wno-psabi",
    "-pthread",
)
MAX_BATCH = 256  # decode_step.c's limit
MAX_HEAD_DIM = 512  # its RoPE buffer
MAX_GQA = 64  # query heads per kv head (its attention's per-group arrays)

W_INT4, W_INT8, W_F32, W_BF16, W_F16, W_W4A8, W_W8A8 = 0, 1, 2, 3, 4, 5, 6
DENSE_KINDS = {torch.float32: W_F32, torch.bfloat16: W_BF16, torch.float16: W_F16}
ISA_NAMES = cpu_features.ISA_CAPS  # kiln_set_isa's levels
KV_F32, KV_BF16, KV_FP8 = 0, 1, 2
KV_KINDS = {torch.float32: KV_F32, torch.bfloat16: KV_BF16, torch.float8_e4m3fn: KV_FP8}


class KilnLinear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
        ("block_n", ctypes.c_int32), ("split", ctypes.c_int32), ("op_group", ctypes.c_int32),
        ("zo_groups", ctypes.c_int32), ("round_out", ctypes.c_int32), ("bf16_rows", ctypes.c_int32),
        ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p),
        ("zero_offsets", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("scales32", ctypes.c_void_p),
    ]  # fmt: skip


class KilnLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("qkv", KilnLinear), ("o", KilnLinear), ("gate_up", KilnLinear), ("down", KilnLinear),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
    ]  # fmt: skip


class KilnModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32),
        ("max_len", ctypes.c_int32), ("vocab", ctypes.c_int32),
        ("kv_kind", ctypes.c_int32), ("round_act", ctypes.c_int32), ("embed_kind", ctypes.c_int32),
        ("head_round_in", ctypes.c_int32),
        ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
        ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("head", ctypes.POINTER(KilnLinear)), ("layers", ctypes.POINTER(KilnLayer)),
    ]  # fmt: skip


def _declare(lib: ctypes.CDLL) -> None:
    lib.kiln_pool_start.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.kiln_pool_start.restype = ctypes.c_int
    lib.kiln_decode_step.argtypes = [ctypes.POINTER(KilnModel), ctypes.c_int, *[ctypes.c_void_p] * 4]
    lib.kiln_decode_step.restype = ctypes.c_int
    lib.kiln_linear_apply.argtypes = [
        ctypes.POINTER(KilnLinear),
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.kiln_linear_apply.restype = ctypes.c_int
    lib.kiln_set_isa.argtypes = [ctypes.c_int]
    lib.kiln_set_isa.restype = ctypes.c_int


LIBRARY = NativeLibrary(
    "native decode step",
    SOURCE,
    FLAGS,
    _declare,
    libs=("-lm",),
    headers=(cpu_w4a8.HEADER,),
    isa_function="kiln_set_isa",
)


class Unsupported(Exception):
    """What keeps a model on the eager decode step."""


def start_pool(lib: ctypes.CDLL, threads: int, spin_us: int) -> int:
    """The library's thread pool (made once per process: later counts are ignored); its size."""
    return int(lib.kiln_pool_start(max(1, threads), max(0, spin_us)))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class LinearDescription:
    """A layer as the library reads it, and the tensors it points into (kept alive here)."""

    struct: KilnLinear
    keep: list[torch.Tensor]


def describe_linear(layer: KernelLinear, *, round_io: bool, op_rounding: bool = True) -> LinearDescription:
    """The library's view of a bound layer; Unsupported when its kernel or layout has no native path.
    `round_io`: the model's activations are bf16 (the output rounded). `op_rounding`: round where the
    kernel's torch op rounds at the batch size (`LinearKernel.bf16_op_rows`), as the eager forward
    does; False: the layer's exact product (the kernel tests)."""
    kernel, spec, tensors = layer.kernel, layer.spec, layer.tensors
    if kernel is None or spec is None:
        raise Unsupported(f"{layer.name} is not bound")
    keep: list[torch.Tensor] = []

    def held(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.contiguous() if dtype is None else t.to(dtype).contiguous()
        keep.append(t)
        return t

    bias = held(tensors.get("bias"), torch.float32)
    bf16_rows = min(kernel.bf16_op_rows(), ALL_ROWS) if op_rounding else 0
    s = KilnLinear(n=spec.n, k=spec.k, round_out=int(round_io), bf16_rows=bf16_rows, bias=_ptr(bias))
    if kernel.name == "cpu_int4":
        if "perm" in tensors:
            raise Unsupported(f"{layer.name}: act-order (a permuted input) has no native path")
        qweight, sz = held(tensors["qweight"]), held(tensors["scales_and_zeros"])
        assert qweight is not None and sz is not None
        block_n, split = (int(v) for v in tensors["pack_format"].tolist())
        offsets = held(tensors.get("zero_offsets"), torch.float32)
        if block_n % 2 or spec.k % sz.shape[0]:
            raise Unsupported(f"{layer.name}: int4 pack blocks of {block_n} rows have no native path")
        s.kind, s.block_n, s.split, s.op_group = W_INT4, block_n, split, spec.k // sz.shape[0]
        s.weight, s.scales = qweight.data_ptr(), sz.data_ptr()
        if offsets is not None:
            s.zo_groups, s.zero_offsets = offsets.shape[0], offsets.data_ptr()
    elif kernel.name == cpu_w4a8.CpuW4A8Kernel.name:
        qweight, scales = held(tensors["qweight"]), held(tensors["scales"])
        assert qweight is not None and scales is not None
        s.kind, s.op_group = W_W4A8, cpu_w4a8.group_of(spec)
        s.weight, s.scales32 = qweight.data_ptr(), scales.data_ptr()
    elif kernel.name == "cpu_w8a8":
        qweight, scales = held(tensors["qweight"]), held(tensors["scales"], torch.float32)
        assert qweight is not None and scales is not None
        s.kind, s.weight, s.scales32 = W_W8A8, qweight.data_ptr(), scales.data_ptr()
    elif kernel.name == "cpu_int8":
        qweight, scales = held(tensors["qweight"]), held(tensors["scales"], torch.bfloat16)
        assert qweight is not None and scales is not None
        s.kind, s.weight, s.scales = W_INT8, qweight.data_ptr(), scales.data_ptr()
    elif kernel.name == "dense" and tensors["weight"].dtype in DENSE_KINDS:
        weight = held(tensors["weight"])
        assert weight is not None
        s.kind, s.weight = DENSE_KINDS[weight.dtype], weight.data_ptr()
    else:
        raise Unsupported(f"{layer.name}: kernel {kernel.name} has no native decode path")
    return LinearDescription(s, keep)


class NativeDecoder:
    """`LlamaForCausalLM.decode` through the native step, for one model and its KV cache."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM, cache: KVCache) -> None:
        self.lib = lib
        self.model = model
        self.cache = cache
        self._keep: list[torch.Tensor] = []
        cfg = model.cfg
        round_act = model.dtype == torch.bfloat16
        self.layers = (KilnLayer * cfg.num_layers)()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(attn, Attention) and isinstance(mlp, MLP)
            ly = self.layers[i]
            ly.input_norm = self._float(layer.input_layernorm.weight)
            ly.post_norm = self._float(layer.post_attention_layernorm.weight)
            if attn.q_norm is not None and attn.k_norm is not None:
                ly.q_norm, ly.k_norm = self._float(attn.q_norm.weight), self._float(attn.k_norm.weight)
            linears = {"qkv": attn.qkv_proj, "o": attn.o_proj}
            linears.update(gate_up=mlp.gate_up_proj, down=mlp.down_proj)
            for field, linear in linears.items():
                described = describe_linear(linear, round_io=round_act)
                self._keep.extend(described.keep)
                setattr(ly, field, described.struct)
        if model.lm_head is not None:
            head = describe_linear(model.lm_head, round_io=round_act)
            self._keep.extend(head.keep)
            self.head = head.struct
            head_round_in = round_act
        else:
            w = model.lm_head_weight
            if w is None or w.dtype not in DENSE_KINDS:
                raise Unsupported(f"an LM head weight in {None if w is None else w.dtype} has no native path")
            w = self._held(w.contiguous())
            self.head = KilnLinear(kind=DENSE_KINDS[w.dtype], n=w.shape[0], k=w.shape[1], weight=w.data_ptr())
            head_round_in = False
        embed = model.embed_tokens.weight
        if embed.dtype not in DENSE_KINDS:
            raise Unsupported(f"an embedding in {embed.dtype} has no native path")
        embed = self._held(embed.contiguous())
        self.vocab_rows = embed.shape[0]
        first = model.layers[0].self_attn
        assert isinstance(first, Attention)
        self.struct = KilnModel(
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=mlp_width(model),
            max_len=cache.max_len,
            vocab=self.head.n,
            kv_kind=KV_KINDS[cache.storage_dtype],
            round_act=int(round_act),
            embed_kind=DENSE_KINDS[embed.dtype],
            head_round_in=int(head_round_in),
            eps=model.norm.eps,
            attn_scale=first.head_dim**-0.5,
            embed=embed.data_ptr(),
            final_norm=self._float(model.norm.weight),
            cos=self._held(model.cos.float().contiguous()).data_ptr(),
            sin=self._held(model.sin.float().contiguous()).data_ptr(),
            head=ctypes.pointer(self.head),
            layers=self.layers,
        )
        self._pointer = ctypes.pointer(self.struct)
        self._scales: tuple[list[float], list[float]] = ([], [])
        self._bind_cache()

    def _held(self, t: torch.Tensor) -> torch.Tensor:
        self._keep.append(t)
        return t

    def _float(self, t: torch.Tensor) -> int:
        return self._held(t.detach().float().contiguous()).data_ptr()

    def _bind_cache(self) -> None:
        """Point every layer at its cache tensors and FP8 scales (again when the scales change)."""
        cache = self.cache
        for i in range(len(self.layers)):
            ly = self.layers[i]
            ly.k_cache, ly.v_cache = cache.k[i].data_ptr(), cache.v[i].data_ptr()
            ly.k_scale, ly.v_scale = cache.k_scale[i], cache.v_scale[i]
        self._scales = (list(cache.k_scale), list(cache.v_scale))

    def decode(
        self, tokens: torch.Tensor, slots: list[int], positions: list[int], cache: KVCache
    ) -> torch.Tensor:
        """One token per sequence: tokens (B,), its cache slot and position. Logits (B, V) fp32."""
        if cache is not self.cache or cache._observe is not None or len(slots) > MAX_BATCH:
            return self.model.decode(tokens, slots, positions, cache)
        if cache.k_scale != self._scales[0] or cache.v_scale != self._scales[1]:
            self._bind_cache()
        b = len(slots)
        ids = tokens.reshape(b).to(torch.long).contiguous()
        # the library indexes with these unchecked: what is out of range stops here
        if not (min(positions) >= 0 and max(positions) < cache.max_len and len(positions) == b):
            raise IndexError(f"decode positions {positions} outside the KV cache of {cache.max_len}")
        if not (min(slots) >= 0 and max(slots) < cache.num_slots):
            raise IndexError(f"decode slots {slots} outside the KV cache's {cache.num_slots}")
        if not (int(ids.min()) >= 0 and int(ids.max()) < self.vocab_rows):
            raise IndexError(f"decode tokens {ids.tolist()} outside the embedding's {self.vocab_rows} rows")
        slot_t = torch.tensor(slots, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        logits = torch.empty(b, self.struct.vocab, dtype=torch.float32)
        rc = self.lib.kiln_decode_step(
            self._pointer, b, ids.data_ptr(), slot_t.data_ptr(), pos_t.data_ptr(), logits.data_ptr()
        )
        if rc != 0:
            raise MemoryError("the native decode step could not allocate its activations")
        return logits


def mlp_width(model: LlamaForCausalLM) -> int:
    mlp = model.layers[0].mlp
    assert isinstance(mlp, MLP) and mlp.down_proj.spec is not None
    return mlp.down_proj.spec.k


def why_not_native(model: LlamaForCausalLM, cache: KVCache) -> str | None:
    """Why this model cannot decode natively (None: it can)."""
    cfg = model.cfg
    if model.device.type != "cpu":
        return f"the model runs on {model.device.type}"
    if model.world_size != 1:
        return "tensor parallelism"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"activation dtype {model.dtype}"
    if cache.storage_dtype not in KV_KINDS or not cache.v:
        return f"a KV cache in {cache.storage_dtype}"
    widths = set()
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
            return f"layer {i} is not dense attention + MLP (MoE or MLA)"
        if attn.window is not None or attn.sinks is not None:
            return f"layer {i} has a sliding window or attention sinks"
        if attn.head_dim > MAX_HEAD_DIM or attn.head_dim % 2:
            return f"head_dim {attn.head_dim}"
        if attn.num_heads // attn.num_kv_heads > MAX_GQA:
            return f"{attn.num_heads // attn.num_kv_heads} query heads per kv head"
        if mlp.down_proj.spec is None:
            return f"layer {i} is not bound"
        widths.add(mlp.down_proj.spec.k)
    if len(widths) > 1 or not cfg.num_layers:
        return "layers of different MLP widths"
    return None


def native_decoder(
    model: LlamaForCausalLM, cache: KVCache, *, threads: int, spin_us: int
) -> NativeDecoder | None:
    """The native step for this model, or None (the reason logged once) to decode eagerly."""
    reason = why_not_native(model, cache)
    lib = None
    if reason is None:
        lib = LIBRARY.get()
        reason = "the native library could not be built" if lib is None else None
    if reason is None and lib is not None:
        try:
            decoder = NativeDecoder(lib, model, cache)
        except Unsupported as e:
            reason = str(e)
        else:
            size = start_pool(lib, threads, spin_us)
            log.info("decode: native step, %d thread(s)", size)
            return decoder
    log.info("decode: eager step (%s)", reason)
    return None
