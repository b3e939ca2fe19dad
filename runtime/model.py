"""The model: the Llama family (Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), SmolLM2 (tied embeddings),
Qwen3 (per-head q/k RMSNorm)), the mixture-of-experts Qwen2-MoE (with its gated shared expert),
Qwen3-MoE and Mixtral (`SparseMoeBlock`), DeepSeek-V2/V3 (multi-head latent attention,
runtime/mla.py; grouped routing, `route`; shared experts) and gpt-oss (attention sinks and a sliding
window on every other layer, `sink_attention`; biased experts with their own activation, run by the
expert-group kernel).

Every linear layer is a `KernelLinear`: the kernel named in the manifest plus the tensors it
prepared, resolved once at load, so the hot path is `kernel.apply(x, tensors, spec)` with no
lookups. Fused layers as the converter writes them: `self_attn.qkv_proj` (q|k|v) and
`mlp.gate_up_proj` (gate|up), split by the shard sizes recorded in their spec.

Tensor parallel (Megatron): qkv_proj / gate_up_proj column-parallel (this rank's heads and
intermediate slice), attention and SwiGLU local, o_proj / down_proj row-parallel followed by an
all-reduce; embeddings, norms and lm_head replicated.

Attention is full where a model's sliding window covers every layer (Mistral): the engine caps the
context at the window, within which both are identical. Where the window applies to some layers only
(gpt-oss), those layers mask the keys older than it.

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

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe_base import MoEKernel, MoESpec
from runtime.kv_cache import KVCache
from runtime.layers import ForwardContext, KernelLinear, RMSNorm
from runtime.mla import ABSORBED_SUFFIXES, MlaAttention, absorbed_name
from runtime.model_layout import ARCHITECTURES, ModelConfig, Routing, rank_shape
from runtime.rope import apply_rope_full, rope_tables, rope_tables_full

# Logits recomputed in fp32 after the (bf16) tied lm_head GEMM: the largest ones, which greedy
# decoding and top logprobs read. bf16 rounding moves a logit by ≤ 2^-9 relative (≈0.06 at 30), so
# the true maximum is always among the top few of the rounded logits.
LM_HEAD_EXACT_TOP = 8
ROUTING_EPS = 1e-20  # added to the sum of the chosen weights before renormalising (as DeepSeek does)
TOP_K_BLOCK = 128  # block size of `top_k_indices`' first pass


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


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


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention in fp32 with one learned logit per head in every row's denominator (gpt-oss's
    sinks: the sink's probability is dropped, the row sums to less than 1). q (B, H, T, D), k / v
    (B, KV, S, D), visible broadcastable to (B, H, T, S) or None -> (B, H, T, D) fp32."""
    groups = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(groups, 1)
    scores = (q.float() @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs @ v.float().repeat_interleave(groups, 1)


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
        self.window = cfg.window(layer_idx)
        # gpt-oss: one logit per head, kept as stored (bound from the artifact)
        self.sinks: nn.Parameter | None = None
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)

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
            if self.sinks is not None or self.window is not None:
                out = self._masked(q, k, v, ctx.visible(self.window, t, q.device)).to(v.dtype)
            else:
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
            if self.sinks is not None or self.window is not None:
                visible = ctx.visible(self.window, ctx.read_len, keys.device)[
                    :, None, None, :
                ]  # (B, 1, 1, S)
                out = self._masked(q, keys, values, visible).to(v.dtype)
            else:
                out = F.scaled_dot_product_attention(
                    q.to(keys.dtype), keys, values, attn_mask=ctx.mask, enable_gqa=True
                ).to(v.dtype)
        if t == 1:  # (b, heads, 1, head_dim) is laid out as (b, 1, heads * head_dim) already
            out = out.reshape(b, 1, self.num_heads * head_dim)
        else:
            out = out.transpose(1, 2).reshape(b, t, self.num_heads * head_dim)
        return self.o_proj.forward(out)

    def _masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Attention over the visible keys (a window, sinks): q (B, H, T, D), k / v (B, KV, S, D)."""
        if self.sinks is not None:
            return sink_attention(q, k, v, self.sinks, visible)
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=visible, enable_gqa=True)


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


def route(
    logits: torch.Tensor, routing: Routing, top_k: int, renormalize: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each (T, top_k), from fp32 router logits (T, E): scores (softmax or
    sigmoid), the experts chosen on the scores plus the correction bias within the best groups,
    weighted by their scores, renormalised when the model says so, times the routed scaling."""
    scores = torch.sigmoid(logits) if routing.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    if routing.groups == 1 and bias is None:
        weights, ids = scores.topk(top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias
        if routing.groups > 1:
            grouped = choice.unflatten(-1, (routing.groups, -1))  # (T, groups, E // groups)
            if routing.group_score == "top2":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            best = group_scores.topk(routing.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTING_EPS)
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    return weights, ids


class SparseMoeBlock(nn.Module):
    """Router (fp32 scores) -> the chosen experts (`route`) -> their MLPs, weighted and summed, plus
    the shared expert(s) when the model has them. Under TP or EP each rank computes a partial sum:
    all-reduced here."""

    def __init__(self, cfg: ModelConfig, idx: int, world_size: int) -> None:
        super().__init__()
        arch = ARCHITECTURES[cfg.architecture]
        assert arch.experts is not None and cfg.moe is not None
        group = arch.experts.group(cfg, idx)
        self.gate = KernelLinear(arch.experts.router(cfg, idx).name)
        self.experts = ExpertGroup(group.name)
        self.top_k = cfg.moe.top_k
        self.renormalize = cfg.moe.renormalize
        self.routing = cfg.moe.routing
        self.all_reduce = world_size > 1
        # DeepSeek-V3: added to the scores for the choice of experts only (kept as stored: fp32)
        self.e_score_correction_bias: nn.Parameter | None = None
        if self.routing.correction_bias:
            bias = torch.empty(cfg.moe.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        # Shared expert(s): a dense MLP (TP-split like any, all-reduced in its down_proj) added after
        # the routed experts' all-reduce; Qwen2-MoE's behind a sigmoid gate.
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: KernelLinear | None = None
        if cfg.moe.shared_expert_intermediate:
            shared = arch.experts.shared_expert(idx)
            self.shared_expert = MLP(shared, world_size)
            if arch.experts.shared_expert_gated:
                self.shared_expert_gate = KernelLinear(f"{shared}_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate.forward(flat).float()
        weights, ids = route(logits, self.routing, self.top_k, self.renormalize, self.e_score_correction_bias)
        y = self.experts.forward(flat, ids, weights)
        if self.all_reduce:
            torch.distributed.all_reduce(y)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(flat).float()
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate.forward(flat).float())  # (T, 1)
            y = y + shared.to(y.dtype)
        return y.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, world_size: int) -> None:
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attention = MlaAttention if cfg.mla is not None else Attention
        self.self_attn: Attention | MlaAttention = attention(cfg, f"{prefix}.self_attn", idx, world_size)
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
        """Embeddings, every norm, DeepSeek's router correction biases and gpt-oss's attention sinks,
        by their HF names."""
        names: dict[str, tuple[nn.Module, str]] = {"model.embed_tokens.weight": (self.embed_tokens, "weight")}
        for path, module in self.named_modules():
            if isinstance(module, RMSNorm):
                names[f"model.{path}.weight"] = (module, "weight")
            elif isinstance(module, SparseMoeBlock) and module.e_score_correction_bias is not None:
                names[f"model.{path}.gate.e_score_correction_bias"] = (module, "e_score_correction_bias")
            elif isinstance(module, Attention) and module.sinks is not None:
                names[f"model.{path}.sinks"] = (module, "sinks")
        return names

    def per_head_parameter_names(self) -> set[str]:
        """Of `hf_parameter_names`, those stored for every attention head (gpt-oss's sinks): a rank
        binds its own heads' share."""
        names = self.hf_parameter_names().items()
        return {name for name, (module, _) in names if isinstance(module, Attention)}

    def derived_parameter_names(self) -> dict[str, tuple[nn.Module, str]]:
        """What the converter derives and stores beside the layers (MLA's absorbed W_UK_T / W_UV),
        by their names in the rank files."""
        names: dict[str, tuple[nn.Module, str]] = {}
        for path, module in self.named_modules():
            if isinstance(module, MlaAttention):
                for suffix in ABSORBED_SUFFIXES:
                    names[f"{absorbed_name('model.' + path)}.{suffix}"] = (module, suffix)
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
        return self._decode_rows(tokens, slot_t, pos, read_slots, read_len, cache)

    def decode_static(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        read_len: int,
        cache: KVCache,
    ) -> torch.Tensor:
        """`decode` at shapes fixed by the caller, every per-step value in a device tensor (what a
        CUDA graph captures): tokens / slots / positions (B,) long, keys read up to `read_len` >= every
        position + 1 (the rest masked). Logits (B, V)."""
        return self._decode_rows(tokens, slots, positions, slots, read_len, cache)

    def _decode_rows(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        pos: torch.Tensor,
        read_slots: slice | torch.Tensor,
        read_len: int,
        cache: KVCache,
    ) -> torch.Tensor:
        mask = (torch.arange(read_len, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        ctx = ForwardContext(
            cache=cache,
            cos=self.cos[pos][:, None, None],
            sin=self.sin[pos][:, None, None],
            act_dtype=self.dtype,
            attn_dtype=self.residual_dtype,
            slots=slots,
            positions=pos,
            read_slots=read_slots,
            read_len=read_len,
            mask=mask,
        )
        hidden = self._body(tokens[:, None], ctx)[:, 0]
        return self.logits(hidden)
