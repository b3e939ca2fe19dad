"""DeepSeek's multi-head latent attention (MLA), as vLLM runs it.

Per token the layer makes one compressed latent `c` (kv_lora_rank L, RMS-normalised) and one rope key
`k_pe` (qk_rope_head_dim R) shared by every head; the KV cache holds only `[c | k_pe]` (L + R values
per token and layer, one "head"). Each head's query is `[q_nope (P) | q_pe (R)]`; its key and value
would be `[W_UK[h] c | k_pe]` and `W_UV[h] c`, with W_UK / W_UV the rows of kv_b_proj.

* Prefill (MHA form): kv_b_proj (the manifest's kernel) expands the prompt's latents into per-head
  keys and values, and attention runs as usual.
* Decode (absorbed form): the query is moved into latent space instead, `q_lat[h] = q_nope[h] @
  W_UK_T[h]` (P -> L), so scores are `q_lat · c + q_pe · k_pe` over the cached entries directly and
  the output is `(attention-weighted c) @ W_UV[h]` (L -> V). W_UK_T (heads, P, L) and W_UV
  (heads, L, V) are derived from kv_b_proj at conversion and stored (vLLM derives them at every load).

RoPE rotates only q_pe / k_pe; DeepSeek pairs its rotary dims as (x0, x1), (x2, x3), ...: both are
de-interleaved (evens, then odds) before the neox-style rotation, which leaves every q_pe · k_pe
unchanged. Softmax scale: (P + R)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.

Under TP the heads are split (q_b_proj / q_proj and kv_b_proj column-parallel by heads, o_proj
row-parallel); the latent projections (fused_qkv_a_proj / kv_a_proj_with_mqa) are replicated, so
every rank caches the same whole latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers import ForwardContext, KernelLinear, RMSNorm
from runtime.model_layout import ModelConfig
from runtime.rope import apply_rope_full, yarn_mscale

ABSORBED_SUFFIXES = ("W_UK_T", "W_UV")  # the tensors the converter derives from kv_b_proj


def absorbed_name(attention: str) -> str:
    """The derived unit holding a layer's W_UK_T / W_UV (`attention` is its self_attn module)."""
    return f"{attention}.kv_b_proj.absorbed"


def mla_softmax_scale(cfg: ModelConfig) -> float:
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim**-0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, layer_idx: int, world_size: int) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads // world_size
        self.nope, self.rope, self.latent = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        self.v_dim = mla.v_head_dim
        self.q_lora = mla.q_lora_rank
        if self.q_lora is not None:
            self.fused_qkv_a_proj = KernelLinear(f"{prefix}.fused_qkv_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg.rms_norm_eps)
            self.q_b_proj = KernelLinear(f"{prefix}.q_b_proj")
        else:
            self.q_proj = KernelLinear(f"{prefix}.q_proj")
            self.kv_a_proj_with_mqa = KernelLinear(f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.latent, cfg.rms_norm_eps)
        self.kv_b_proj = KernelLinear(f"{prefix}.kv_b_proj")
        self.o_proj = KernelLinear(f"{prefix}.o_proj", all_reduce=world_size > 1)
        heads = self.num_heads
        self.W_UK_T = nn.Parameter(torch.empty(heads, self.nope, self.latent), requires_grad=False)
        self.W_UV = nn.Parameter(torch.empty(heads, self.latent, self.v_dim), requires_grad=False)
        self.scale = mla_softmax_scale(cfg)
        self.interleaved = mla.rope_interleaved

    def _rotate(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: (B, heads, T, R) in the rope layout of the checkpoint."""
        if self.interleaved:  # dims (0, 2, 4, ..., 1, 3, 5, ...): the pairs as the halves neox rotates
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope_full(x.to(ctx.cos.dtype), ctx.cos, ctx.sin)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, t, _ = x.shape
        norm_dtype = ctx.cos.dtype  # the residual dtype: norms and rope run in it
        if self.q_lora is not None:
            q_a, kv_a = self.fused_qkv_a_proj.forward(x).split([self.q_lora, self.latent + self.rope], -1)
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(q_a.to(norm_dtype)).to(x.dtype))
        else:
            q, kv_a = self.q_proj.forward(x), self.kv_a_proj_with_mqa.forward(x)
        q_nope, q_pe = q.view(b, t, self.num_heads, -1).split([self.nope, self.rope], -1)
        latent, k_pe = kv_a.split([self.latent, self.rope], -1)
        latent = self.kv_a_layernorm.forward(latent.to(norm_dtype))  # (b, t, L)
        q_pe = self._rotate(q_pe.transpose(1, 2), ctx)  # (b, heads, t, R)
        k_pe = self._rotate(k_pe[:, None], ctx)  # (b, 1, t, R)
        entry = torch.cat((latent[:, None], k_pe), dim=-1)  # (b, 1, t, L + R): what the cache holds
        if ctx.prefill_slot is not None:
            out = self._prefill(q_nope, q_pe, latent, k_pe, entry, ctx)
        else:
            out = self._decode(q_nope, q_pe, entry, ctx)
        return self.o_proj.forward(out.to(x.dtype))

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        entry: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """One sequence from position 0, attending to itself causally through kv_b_proj's keys and
        values: (1, t, heads * V)."""
        assert ctx.prefill_slot is not None
        ctx.cache.write_prefill(self.layer_idx, ctx.prefill_slot, entry[0])
        _, t, heads, _ = q_nope.shape
        kv = self.kv_b_proj.forward(latent.to(q_nope.dtype)).view(1, t, heads, -1).transpose(1, 2)
        k_nope, v = kv.to(q_pe.dtype).split([self.nope, self.v_dim], -1)  # (1, heads, t, P) / (.., V)
        k = torch.cat((k_nope, k_pe.expand(-1, heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope.transpose(1, 2).to(q_pe.dtype), q_pe), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.scale)
        return out.transpose(1, 2).reshape(1, t, heads * self.v_dim)

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """One new token per sequence, attending to its cached latents in latent space: (b, 1, heads * V)."""
        cache, layer = ctx.cache, self.layer_idx
        if ctx.single is not None:
            cache.write_decode_one(layer, *ctx.single, entry[0, :, 0])
        else:
            cache.write_decode(layer, ctx.slots, ctx.positions, entry[:, :, 0])
        b = q_nope.shape[0]
        w_uk_t, w_uv = self.W_UK_T, self.W_UV
        q_lat = torch.einsum("bhp,hpl->bhl", q_nope[:, 0].to(w_uk_t.dtype), w_uk_t)  # (b, heads, L)
        dtype = ctx.attn_dtype
        q = torch.cat((q_lat.to(dtype), q_pe[:, :, 0].to(dtype)), dim=-1)[:, :, None]  # (b, h, 1, L + R)
        keys = cache.read_keys_as(layer, ctx.read_slots, ctx.read_len, dtype)  # (b, 1, len, L + R)
        out_lat = F.scaled_dot_product_attention(
            q, keys, keys[..., : self.latent], attn_mask=ctx.mask, scale=self.scale, enable_gqa=True
        )  # (b, heads, 1, L)
        out = torch.einsum("bhl,hlv->bhv", out_lat[:, :, 0].to(w_uv.dtype), w_uv)  # (b, heads, V)
        return out.reshape(b, 1, self.num_heads * self.v_dim)
