"""MLA's absorbed matrices as plan units: what vLLM derives from every DeepSeek layer's kv_b_proj at each
load (its MLA `process_weights_after_loading`), derived here once and stored per rank.

kv_b_proj (heads·(P + V), L) holds, per head h, P rows that expand the latent into the head's
no-rope key, then V rows that expand it into its value. Dequantized (fp32) and cast to the activation
dtype, as vLLM does:

    W_UK_T[h] = rows [h(P+V), h(P+V) + P)           (heads, P, L)
    W_UV[h]   = rows [h(P+V) + P, (h+1)(P+V)), transposed   (heads, L, V)

On GPU targets they are stored in the activation dtype, as vLLM holds them. On the CPU target they
are stored in fp32: the CPU decode multiplies by them in fp32, and bf16-rounded ones cost ≈0.02-0.04
in the logits of a decode step (measured on an FP8-block DeepSeek-V3: the prefill, through kv_b_proj,
matches transformers to 1e-6) — enough to flip an expert at a router near-tie.

Each rank holds its own heads (kv_b_proj is column-parallel by heads). The linear kv_b_proj itself
stays a layer of its own (the prefill expands latents through it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kernels.base import Target
from runtime.artifact.manifest import DerivedEntry
from runtime.mla import ABSORBED_SUFFIXES, absorbed_name
from runtime.model_layout import ARCHITECTURES, LinearLayout, MlaConfig, RowRange
from services.convert.formats.base import LayerQuant
from services.convert.tp import slice_rows
from services.convert.units.base import (
    HEADER_ENTRY_BYTES,
    PlanContext,
    PlanRow,
    RankFiles,
    check_source_shape,
    quantize_online,
    require_reproduced,
)
from services.convert.verify import compare, worst_of


@dataclass(frozen=True)
class MlaAbsorption:
    """The derivation, named like a kernel (its version is part of the artifact id)."""

    name: str = "mla_absorbed"
    layout_version: int = 1


ABSORPTION = MlaAbsorption()


@dataclass
class AbsorbedMlaUnit:
    section: ClassVar[str] = "derived"

    kv_b_proj: LinearLayout
    quant: LayerQuant
    mla: MlaConfig
    tp: int
    dtype: str  # what W_UK_T / W_UV are stored in
    source_tensors: list[str]
    online_fp8: LayerQuant | None = None  # --method fp8: derived from kv_b_proj as quantized
    kernel: MlaAbsorption = ABSORPTION
    rejected: list[tuple[str, str]] = field(default_factory=list)
    fallback: bool = False

    @property
    def name(self) -> str:
        return absorbed_name(self.kv_b_proj.name.removesuffix(".kv_b_proj"))

    @property
    def heads_per_rank(self) -> int:
        return self.kv_b_proj.shards[0].heads // self.tp

    def row(self) -> PlanRow:
        mla = self.mla
        return PlanRow(
            layer=self.name,
            shards=[self.kv_b_proj.name],
            scheme=f"W_UK_T / W_UV derived from kv_b_proj ({self._kv_b_scheme()}), {self.dtype}",
            kernel=self.kernel.name,
            fallback=False,
            rejections=[],
            n=self.heads_per_rank * (mla.qk_nope_head_dim + mla.v_head_dim),
            k=mla.kv_lora_rank,
        )

    def _kv_b_scheme(self) -> str:
        online = self.online_fp8
        return self.quant.describe() if online is None else f"{online.describe()} (online)"

    def stored_bytes(self, rank: int, target: Target) -> int:
        mla = self.mla
        per_head = mla.kv_lora_rank * (mla.qk_nope_head_dim + mla.v_head_dim)
        return self.heads_per_rank * per_head * getattr(torch, self.dtype).itemsize

    def header_bytes(self) -> int:
        return len(ABSORBED_SUFFIXES) * (len(self.name) + 8 + HEADER_ENTRY_BYTES)

    def convert(self, files: RankFiles) -> DerivedEntry:
        module = self.kv_b_proj.shards[0].module
        tensors = files.ckpt.read(self.source_tensors)
        source = files.fmt.decode(module, self.quant, tensors)
        del tensors
        check_source_shape(module, source, (self.kv_b_proj.n, self.kv_b_proj.k))
        dtype: torch.dtype = getattr(torch, self.dtype)
        nope, heads = self.mla.qk_nope_head_dim, self.heads_per_rank
        rows = self.kv_b_proj.n // self.tp
        worst = None
        for rank, writer in enumerate(files.writers):
            rank_source = slice_rows(source, RowRange(rank * rows, rows), module)
            if self.online_fp8 is not None:  # as the kv_b_proj layer stores it (vLLM: dequantized again)
                rank_source = quantize_online(rank_source, self.online_fp8)
            per_head = rank_source.dequantize().float().view(heads, -1, self.mla.kv_lora_rank)
            w_uk_t = per_head[:, :nope].to(dtype).contiguous()  # (heads, P, L)
            w_uv = per_head[:, nope:].transpose(1, 2).to(dtype).contiguous()  # (heads, L, V)
            # The stored pair, laid back out as kv_b_proj's rows, against the source's.
            rebuilt = torch.cat((w_uk_t, w_uv.transpose(1, 2)), dim=1).reshape(rows, -1)
            check = compare(rebuilt, rank_source, dtype)  # the rounding to `dtype` only
            require_reproduced(check, f"{self.name} (rank {rank})")
            worst = worst_of(worst, check)
            writer.add(f"{self.name}.W_UK_T", w_uk_t)
            writer.add(f"{self.name}.W_UV", w_uv)
        return DerivedEntry(
            kernel=self.kernel.name,
            layout_version=self.kernel.layout_version,
            tensors=list(ABSORBED_SUFFIXES),
            source_tensors=list(self.source_tensors),
            verification=worst,
        )


class AbsorbedMlaKind:
    """One unit per MLA layer (none for other architectures)."""

    def module_count(self, ctx: PlanContext) -> int:
        return 0  # its kv_b_proj modules are the linear kind's

    def plan(self, ctx: PlanContext) -> list[AbsorbedMlaUnit]:
        mla = ctx.model.mla
        if mla is None:
            return []
        arch = ARCHITECTURES[ctx.model.architecture]
        dtype = "float32" if ctx.target is Target.CPU else ctx.act_dtype
        units = []
        for layer in range(ctx.model.num_layers):
            kv_b = next(
                lin for lin in arch.attention_linears(ctx.model, layer) if lin.name.endswith(".kv_b_proj")
            )
            quant = ctx.fmt.layer_quant(kv_b.name, kv_b)
            sources = ctx.fmt.source_tensors(kv_b.name, quant)
            online = ctx.online_fp8 if quant.scheme == "dense" else None
            units.append(AbsorbedMlaUnit(kv_b, quant, mla, ctx.tp, dtype, sources, online))
        return units

    def notes(self, ctx: PlanContext) -> list[str]:
        model = ctx.model
        if model.mla is None:
            return []
        return [mla_cache_note(model.mla, model.num_layers, model.num_heads, ctx.act_dtype)]


def mla_cache_note(mla: MlaConfig, num_layers: int, num_heads: int, act_dtype: str) -> str:
    """What `kiln plan` says about MLA's KV cache, next to the multi-head cache it replaces."""
    itemsize = getattr(torch, act_dtype).itemsize
    latent = num_layers * mla.latent_dim * itemsize
    mha = mla.mha_kv_bytes_per_token(num_layers, num_heads, itemsize)
    return (
        f"MLA KV cache: {latent:,} bytes per token ({num_layers} layers × (kv_lora_rank {mla.kv_lora_rank} + "
        f"rope {mla.qk_rope_head_dim}) × {act_dtype}), vs {mha:,} for the same attention as multi-head K/V "
        f"({latent / mha:.3f}×; the absorbed W_UK_T / W_UV are stored per layer)"
    )


__all__ = ["AbsorbedMlaKind", "AbsorbedMlaUnit"]
