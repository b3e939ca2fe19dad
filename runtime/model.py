"""The Llama family in one file: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), SmolLM2 (tied embeddings),
Qwen3 (per-head q/k RMSNorm), and the mixture-of-experts Qwen2-MoE (with its gated shared expert),
Qwen3-MoE and Mixtral (`SparseMoeBlock`).

Every linear layer is a `KernelLinear`: the kernel named in the manifest plus the tensors it
prepared, resolved once at load, so the hot path is `kernel.apply(x, tensors, spec)` with no
lookups. Fused layers as the converter writes them: `self_attn.qkv_proj` (q|k|v) and
`mlp.gate_up_proj` (gate|up), split by the shard sizes recorded in their spec.

Tensor parallel (Megatron): qkv_proj / gate_up_proj column-parallel (this rank's heads and
intermediate slice), attention and SwiGLU local, o_proj / down_proj row-parallel followed by an
all-reduce; embeddings, norms and lm_head replicated.

Attention is full (no sliding window): the engine caps the context at a model's sliding_window,
within which both are identical.

Shapes: the model runs on (B, T) token ids; prefill is one sequence (B=1) from position 0,
decode is B sequences with one token each at their own positions.

Dtypes: `dtype` is the activation dtype the linear kernels, attention and the KV cache run in;
`residual_dtype` is that of the residual stream, the RMSNorms and RoPE. On GPU both are the
artifact's act dtype. On CPU the residual stays fp32 (cheap at these sizes; 30 bf16 residual
additions would drift from the fp32 reference) while the activations are bf16 when the kernels'
fast paths want bf16 (`runtime.loader.compute_dtype`): each norm output is rounded to bf16 once,
which the kernels would do anyway.

The tied lm_head multiplies by the embedding as stored (bf16 for SmolLM2) with the hidden state
rounded to that dtype: no load-time fp32 copy (≈113 MB for SmolLM2), half the bytes per token.
The logits come out of the bf16 GEMM rounded to bf16 (≤ 2^-9 relative, ≈0.03-0.06 at typical
top logits); the top `LM_HEAD_EXACT_TOP` are then recomputed in fp32 from the fp32 hidden state,
so greedy decoding sees exact maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.base import LinearKernel, LinearSpec
from kernels.errors import UnsupportedError
from kernels.moe_base import MoEKernel, MoESpec
from runtime.kv_cache import KVCache
from runtime.model_layout import ARCHITECTURES, ModelConfig, ModelConfigError, rank_shape

# Logits recomputed in fp32 after the (bf16) tied lm_head GEMM: the largest ones, which greedy
# decoding and top logprobs read. bf16 rounding moves a logit by ≤ 2^-9 relative (≈0.06 at 30), so
# the true maximum is always among the top few of the rounded logits.
LM_HEAD_EXACT_TOP = 8
TOP_K_BLOCK = 128  # block size of `top_k_indices`' first pass


# ------------------------------------------------------------------------------------------------
# Rotary embeddings (neox style: rotate the two halves of each head, HF layout)
# ------------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig, max_len: int) -> torch.Tensor:
    """(head_dim // 2,) float64 inverse frequencies, rope scaling applied."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "dynamic":
        # Dynamic NTK with the table built once for max_len (as vLLM does); identical to the
        # unscaled rope while max_len stays within the original context.
        orig = int(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
        factor = float(scaling["factor"])
        if max_len > orig:
            base = base * ((factor * max_len / orig) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by factor, short ones kept, the band between interpolated
        smooth = ((orig / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= orig / low) & (wavelen >= orig / high)
        return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise UnsupportedError(
        f"rope_scaling type {kind!r} is not supported (supported: llama3, linear, dynamic)"
    )


def check_rope(cfg: ModelConfig) -> None:
    """The rotary frequencies this config gives (up to its longest context) are computable, finite
    and positive in fp32: UnsupportedError for a rope scaling kind this model lacks, ModelConfigError for
    values that together give NaN, infinite or zero frequencies."""
    try:
        inv_freq = rope_inv_freq(cfg, cfg.max_position_embeddings).float()  # as rope_tables uses them
    except (ZeroDivisionError, OverflowError) as e:
        raise ModelConfigError(
            f"rope_theta = {cfg.rope_theta} with rope scaling {cfg.rope_scaling} and head_dim = "
            f"{cfg.head_dim}: the rotary frequencies cannot be computed ({e}); the model config is "
            "corrupt or was altered — re-convert the checkpoint"
        ) from e
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        raise ModelConfigError(
            f"rope_theta = {cfg.rope_theta} with rope scaling {cfg.rope_scaling} gives non-finite or "
            "zero rotary frequencies; the model config is corrupt or was altered — re-convert the checkpoint"
        )


def rope_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_len, head_dim // 2)."""
    inv_freq = rope_inv_freq(cfg, max_len).float()
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos/sin: (B, 1, T, head_dim // 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_tables_full(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos | cos, -sin | sin): (max_len, head_dim), the tables `apply_rope_full` takes."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in 3 ops: x * (cos|cos) + (x2|x1) * (-sin|sin). Tables (B, 1, T, head_dim).

    (x2|x1) is x rolled by half a head: one op instead of two slices and a cat, same values."""
    return torch.addcmul(x * cos_full, x.roll(x.shape[-1] // 2, -1), sin_signed)


def top_k_indices(x: torch.Tensor, k: int, block: int = TOP_K_BLOCK) -> torch.Tensor:
    """`x.topk(k, dim=-1).indices` (the same set up to ties) in two small top-k passes: the k
    largest values lie in the k blocks with the largest maxima. Over a vocabulary, a plain top-k
    allocates a (value, index) buffer the size of the row per call (≈0.3 ms measured at 49k)."""
    v = x.shape[-1]
    if v % block or v // block < k:
        return x.topk(k, dim=-1).indices
    blocks = x.unflatten(-1, (v // block, block))  # (..., V // block, block)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # (..., k) blocks holding the top k
    within = torch.take_along_dim(blocks, best.unsqueeze(-1), dim=-2).flatten(-2)  # (..., k * block)
    idx = within.topk(k, dim=-1).indices
    return best.gather(-1, idx // block) * block + idx % block


def residual_dtype(act_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """fp32 residual stream / norms / RoPE on CPU; the activation dtype on GPU."""
    return torch.float32 if torch.device(device).type == "cpu" else act_dtype


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------


class KernelLinear(nn.Module):
    """y = x @ W.T (+ bias) through the kernel the manifest names; tensors bound at load."""

    def __init__(self, name: str, *, all_reduce: bool = False) -> None:
        super().__init__()
        self.name = name
        self.all_reduce = all_reduce  # row-parallel layer under TP > 1
        self.kernel: LinearKernel | None = None
        self.spec: LinearSpec | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def bind(self, kernel: LinearKernel, spec: LinearSpec, tensors: dict[str, torch.Tensor]) -> None:
        self.kernel, self.spec, self.tensors = kernel, spec, tensors
        for suffix, t in tensors.items():
            self.register_buffer(suffix, t, persistent=False)
        # A closure with every tensor, shape and option resolved once (no lookups per call).
        self._apply = kernel.bind_apply(tensors, spec)
        if not self.all_reduce:  # `forward` is then the bound closure itself: one call less per use
            self.forward = self._apply  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._apply(x)
        if self.all_reduce:
            torch.distributed.all_reduce(y)
        return y

    def shard_sizes(self) -> list[int]:
        assert self.spec is not None, f"{self.name} is not bound"
        return [s.size for s in self.spec.shards] or [self.spec.n]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, layer_idx: int, world_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # This rank's heads, as runtime/model_layout.py splits (or replicates) them.
        layouts = ARCHITECTURES[cfg.architecture].decoder_linears(cfg, layer_idx)
        qkv = next(layout for layout in layouts if layout.name == f"{prefix}.qkv_proj")
        q, k, _ = rank_shape(qkv, cfg, 0, world_size).shard_sizes
        self.num_heads = q // cfg.head_dim
        self.num_kv_heads = k // cfg.head_dim
        self.head_dim = cfg.head_dim
        self.qkv_proj = KernelLinear(f"{prefix}.qkv_proj")
        self.o_proj = KernelLinear(f"{prefix}.o_proj", all_reduce=world_size > 1)
        self.split = [(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim]
        # Qwen3: every q and k head RMS-normalised over head_dim before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, t, _ = x.shape
        head_dim = self.head_dim
        qk, v = self.qkv_proj.forward(x).split(self.split, dim=-1)
        qk = qk.view(b, t, -1, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = qk.to(ctx.cos.dtype)
            q, k = qk[:, :, : self.num_heads], qk[:, :, self.num_heads :]
            qk = torch.cat((self.q_norm.forward(q), self.k_norm.forward(k)), dim=2)
        # q and k heads rotated in one call (in the tables' dtype): (b, heads + kv_heads, t, head_dim)
        qk = apply_rope_full(qk.transpose(1, 2), ctx.cos, ctx.sin)
        v = v.view(b, t, self.num_kv_heads, head_dim).transpose(1, 2)
        cache = ctx.cache
        if ctx.prefill_slot is not None:  # one sequence from position 0: attend to itself, causally
            qk = qk.to(v.dtype)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            cache.write_prefill(self.layer_idx, ctx.prefill_slot, k[0], v[0])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        else:  # one new token per sequence at its own position
            # q and k stay in the rope dtype: the cache write rounds k to the cache dtype, and the
            # attention runs in `attn_dtype` (fp32 on CPU, where torch's bf16 SDPA is 2.5-5x slower
            # than converting the cached keys/values and running it in fp32, measured at B=1 and 8).
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            if ctx.single is not None:  # batch 1: plain slice copies, no index tensors
                cache.write_decode_one(self.layer_idx, *ctx.single, k[0, :, 0], v[0, :, 0])
            else:
                cache.write_decode(self.layer_idx, ctx.slots, ctx.positions, k[:, :, 0], v[:, :, 0])
            keys, values = cache.read_as(self.layer_idx, ctx.read_slots, ctx.read_len, ctx.attn_dtype)
            out = F.scaled_dot_product_attention(
                q.to(keys.dtype), keys, values, attn_mask=ctx.mask, enable_gqa=True
            ).to(v.dtype)
        if t == 1:  # (b, heads, 1, head_dim) is laid out as (b, 1, heads * head_dim) already
            out = out.reshape(b, 1, self.num_heads * head_dim)
        else:
            out = out.transpose(1, 2).reshape(b, t, self.num_heads * head_dim)
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, prefix: str, world_size: int) -> None:
        super().__init__()
        self.gate_up_proj = KernelLinear(f"{prefix}.gate_up_proj")
        self.residual_dtype = torch.float32  # set by LlamaForCausalLM.setup
        self.down_proj = KernelLinear(f"{prefix}.down_proj", all_reduce=world_size > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        gate, up = gate_up.chunk(2, dim=-1)
        # SwiGLU in fp32 on CPU, rounded once to the activation dtype at down_proj's input (which
        # the kernel would do itself; explicit, its output stays in that dtype for the residual add)
        return self.down_proj.forward(F.silu(gate.to(self.residual_dtype)).mul_(up).to(gate_up.dtype))


class ExpertGroup(nn.Module):
    """A MoE layer's experts through the expert-group kernel the manifest names; bound at load."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.kernel: MoEKernel | None = None
        self.spec: MoESpec | None = None

    def bind(self, kernel: MoEKernel, spec: MoESpec, tensors: dict[str, torch.Tensor]) -> None:
        self.kernel, self.spec = kernel, spec
        for name, t in tensors.items():
            self.register_buffer(name.replace(".", "_"), t, persistent=False)
        self.forward = kernel.bind_apply(tensors, spec)  # type: ignore[method-assign]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.name} is not bound to an artifact")


class SparseMoeBlock(nn.Module):
    """Router -> softmax (fp32) -> top-k (renormalised when the model says so) -> the experts' MLPs,
    weighted and summed. Under TP or EP each rank computes a partial sum: all-reduced here."""

    def __init__(self, cfg: ModelConfig, idx: int, world_size: int) -> None:
        super().__init__()
        arch = ARCHITECTURES[cfg.architecture]
        assert arch.experts is not None and cfg.moe is not None
        group = arch.experts.group(cfg, idx)
        self.gate = KernelLinear(arch.experts.router(cfg, idx).name)
        self.experts = ExpertGroup(group.name)
        self.top_k = cfg.moe.top_k
        self.renormalize = cfg.moe.renormalize
        self.all_reduce = world_size > 1
        # Qwen2-MoE's shared expert: a dense MLP (TP-split like any, all-reduced in its down_proj)
        # behind a sigmoid gate, added after the routed experts' all-reduce.
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: KernelLinear | None = None
        if cfg.moe.shared_expert_intermediate:
            shared = arch.experts.shared_expert(idx)
            self.shared_expert = MLP(shared, world_size)
            self.shared_expert_gate = KernelLinear(f"{shared}_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate.forward(flat).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts.forward(flat, ids, weights)
        if self.all_reduce:
            torch.distributed.all_reduce(y)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(self.shared_expert_gate.forward(flat).float())  # (T, 1)
            y = y + (self.shared_expert.forward(flat).float() * scale).to(y.dtype)
        return y.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, world_size: int) -> None:
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", idx, world_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, idx, world_size)
            if cfg.is_moe_layer(idx)
            else MLP(f"{prefix}.mlp", world_size)
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        act = ctx.act_dtype
        norm = self.input_layernorm
        x = x + self.self_attn.forward(F.rms_norm(x, norm.shape, norm.weight, norm.eps).to(act), ctx)
        norm = self.post_attention_layernorm
        return x.add_(self.mlp.forward(F.rms_norm(x, norm.shape, norm.weight, norm.eps).to(act)))


@dataclass
class ForwardContext:
    """Per-forward state shared by every layer (built once per step, not per layer)."""

    cache: KVCache
    cos: torch.Tensor  # (B, 1, T, head_dim): cos | cos
    sin: torch.Tensor  # (B, 1, T, head_dim): -sin | sin
    act_dtype: torch.dtype = torch.float32
    attn_dtype: torch.dtype = torch.float32  # decode attention (the residual dtype)
    prefill_slot: int | None = None
    slots: torch.Tensor | None = None  # (B,) decode: cache slot of each sequence
    positions: torch.Tensor | None = None  # (B,) decode: position of the new token
    read_slots: slice | torch.Tensor | None = None  # a slice when the slots are contiguous (no gather)
    read_len: int = 0
    mask: torch.Tensor | None = None  # (B, 1, 1, read_len) bool, None when B == 1
    single: tuple[int, int] | None = None  # decode with B == 1: (slot, position)


class LlamaForCausalLM(nn.Module):
    """Build on the meta device; `runtime.loader` binds every tensor from the artifact."""

    def __init__(self, cfg: ModelConfig, *, world_size: int = 1, has_lm_head: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.world_size = world_size
        # `_weight` skips nn.Embedding's normal_ init: on the meta device that init imports
        # torch._dynamo (≈1.5 s of a cold start) only to be overwritten by the artifact's tensor.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, world_size) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A kernel layer when the artifact has an `lm_head` entry; else the tied / plain weight.
        self.lm_head = KernelLinear("lm_head") if has_lm_head else None
        self.lm_head_weight: torch.Tensor | None
        self.register_buffer("lm_head_weight", None, persistent=False)
        self.dtype = torch.float32
        self.residual_dtype = torch.float32
        self._head_bf16: torch.Tensor | None = None
        self.device = torch.device("cpu")
        self.cos = self.sin = torch.empty(0)

    # names as the artifact stores them -> modules / parameters
    def linear_layers(self) -> dict[str, KernelLinear]:
        return {m.name: m for m in self.modules() if isinstance(m, KernelLinear)}

    def expert_groups(self) -> dict[str, ExpertGroup]:
        return {m.name: m for m in self.modules() if isinstance(m, ExpertGroup)}

    def hf_parameter_names(self) -> dict[str, tuple[nn.Module, str]]:
        names: dict[str, tuple[nn.Module, str]] = {"model.embed_tokens.weight": (self.embed_tokens, "weight")}
        for i, layer in enumerate(self.layers):
            names[f"model.layers.{i}.input_layernorm.weight"] = (layer.input_layernorm, "weight")
            attn = layer.self_attn
            if attn.q_norm is not None and attn.k_norm is not None:
                names[f"model.layers.{i}.self_attn.q_norm.weight"] = (attn.q_norm, "weight")
                names[f"model.layers.{i}.self_attn.k_norm.weight"] = (attn.k_norm, "weight")
            names[f"model.layers.{i}.post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm,
                "weight",
            )
        names["model.norm.weight"] = (self.norm, "weight")
        return names

    def setup(self, dtype: torch.dtype, max_len: int, device: torch.device | str) -> None:
        """After binding: activation dtype and rope tables for positions [0, max_len)."""
        self.dtype = dtype
        self.device = torch.device(device)
        self.residual_dtype = residual_dtype(dtype, self.device)
        for mlp in self.modules():
            if isinstance(mlp, MLP):
                mlp.residual_dtype = self.residual_dtype
        cos, sin = rope_tables(self.cfg, max_len, self.residual_dtype)
        self.cos, self.sin = (t.to(device) for t in rope_tables_full(cos, sin))

    # ---------------------------------------------------------------------------------------------

    def _body(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens.weight).to(self.residual_dtype)
        for layer in self.layers:
            x = layer.forward(x, ctx)
        return self.norm.forward(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final-norm output (in the residual dtype)."""
        if self.lm_head is not None:
            return self.lm_head.forward(hidden.to(self.dtype)).float()
        w = self.lm_head_weight
        assert w is not None
        if w.dtype == hidden.dtype:
            return F.linear(hidden, w).float()
        gemm_w = w
        if (
            w.dtype == torch.float16
            and self.device.type == "cpu"
            and hidden.dim() > 1
            and hidden.shape[0] > 1
        ):
            gemm_w = self._lm_head_bf16()
        logits = F.linear(hidden.to(gemm_w.dtype), gemm_w).float()
        # The GEMM rounds every logit to w's dtype; recompute the top few in fp32 from the fp32 hidden
        # state so that greedy choices and the leading logprobs are not decided by that rounding.
        top = top_k_indices(logits, LM_HEAD_EXACT_TOP)  # (..., k)
        exact = (w[top].to(hidden.dtype) @ hidden.unsqueeze(-1)).squeeze(-1)  # (..., k)
        return logits.scatter_(-1, top, exact)

    def _lm_head_bf16(self) -> torch.Tensor:
        """A bf16 copy of an fp16 lm_head weight, made on the first call with several rows: CPU fp16
        GEMMs are fast for one row (3 ms for SmolLM2's head) but ≈10x slower than bf16 for 8 rows.
        The top logits are recomputed from the fp16 weight, so the copy's rounding never picks them."""
        if self._head_bf16 is None:
            assert self.lm_head_weight is not None
            self._head_bf16 = self.lm_head_weight.to(torch.bfloat16)
        return self._head_bf16

    def prefill(
        self, input_ids: torch.Tensor, slot: int, cache: KVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """input_ids (T,) from position 0 into `slot`. Logits (V,) of the last position, or (T, V)."""
        t = input_ids.shape[0]
        ctx = ForwardContext(
            cache=cache,
            cos=self.cos[:t][None, None],
            sin=self.sin[:t][None, None],
            act_dtype=self.dtype,
            prefill_slot=slot,
        )
        hidden = self._body(input_ids[None], ctx)[0]
        return self.logits(hidden if all_logits else hidden[-1])

    def decode(
        self, tokens: torch.Tensor, slots: list[int], positions: list[int], cache: KVCache
    ) -> torch.Tensor:
        """One token per sequence: tokens (B,), its cache slot and position. Logits (B, V)."""
        b = len(slots)
        read_len = max(positions) + 1
        if b == 1:
            p = positions[0]
            ctx = ForwardContext(
                cache=cache,
                cos=self.cos[p : p + 1][None, None],
                sin=self.sin[p : p + 1][None, None],
                act_dtype=self.dtype,
                attn_dtype=self.residual_dtype,
                read_slots=slice(slots[0], slots[0] + 1),
                read_len=read_len,
                single=(slots[0], p),
            )
            return self.logits(self._body(tokens[:, None], ctx)[:, 0])
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        contiguous = slots == list(range(slots[0], slots[0] + b))
        read_slots: slice | torch.Tensor = slice(slots[0], slots[0] + b) if contiguous else slot_t
        mask = (torch.arange(read_len, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        ctx = ForwardContext(
            cache=cache,
            cos=self.cos[pos][:, None, None],
            sin=self.sin[pos][:, None, None],
            act_dtype=self.dtype,
            attn_dtype=self.residual_dtype,
            slots=slot_t,
            positions=pos,
            read_slots=read_slots,
            read_len=read_len,
            mask=mask,
        )
        hidden = self._body(tokens[:, None], ctx)[:, 0]
        return self.logits(hidden)
