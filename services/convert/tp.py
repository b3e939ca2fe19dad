"""Tensor-parallel slicing and fusing of canonical weights (docs/formats.md §9), done before layout prep.

Column-parallel layers (qkv_proj, gate_up_proj) split output features per shard: q by attention
heads, k/v by KV heads (replicated when kv_heads < tp: rank r holds KV head r // (tp // kv_heads)),
gate/up evenly. Row-parallel layers (o_proj, down_proj) split input features; their group scales
and zero points split along G, except with act-order (every rank keeps all groups g_idx can name,
g_idx itself is split) and channelwise scales (replicated), as vLLM's
marlin_repeat_scales_on_all_ranks. lm_head, embeddings and norms are replicated on every rank
(Kiln does not shard the vocabulary).
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.base import DenseWeight, Fp4Weight, Fp8Weight, IntWeight, SourceWeight, weight_shape
from kernels.errors import UnsupportedError
from runtime.model_layout import RowRange
from services.convert.errors import ConversionError


def slice_rows(w: SourceWeight, r: RowRange, name: str) -> SourceWeight:
    s, e = r.start, r.start + r.size
    bias = None if w.bias is None else w.bias[s:e]
    if isinstance(w, IntWeight):
        return dataclasses.replace(w.rows(slice(s, e)), bias=bias)
    if isinstance(w, Fp8Weight):
        n = w.weight.shape[0]
        if w.strategy == "tensor":
            scale = w.scale
        elif w.strategy == "channel":
            scale = w.scale[s:e]
        else:
            assert w.block_size is not None
            bn = w.block_size[0]
            if s % bn or (e % bn and e != n):
                raise UnsupportedError(
                    f"{name}: FP8 block size {bn} does not divide the rank slice [{s}, {e}) of the "
                    "output features; use a TP size whose per-rank output is a multiple of the block"
                )
            scale = w.scale[s // bn : -(-e // bn)]
        return Fp8Weight(w.weight[s:e], scale, w.strategy, w.block_size, (), bias)
    if isinstance(w, Fp4Weight):
        g = w.row_global()
        if g is not None and w.shard_sizes and len(w.shard_sizes) > 1:
            raise ConversionError(f"{name}: a fused FP4 weight is sliced by rows before fusing, not after")
        return Fp4Weight(w.codes[s:e], w.scales[s:e], w.fmt, w.global_scale, (), bias)
    return DenseWeight(w.weight[s:e], bias)


def slice_cols(w: SourceWeight, rank: int, tp: int, name: str) -> SourceWeight:
    """Row-parallel slice: input features [rank*K/tp, (rank+1)*K/tp). A bias (N,) is kept whole on
    every rank; the runtime adds it on rank 0 only, before the all-reduce (as vLLM does)."""
    if tp == 1:
        return w
    k = weight_shape(w)[1]
    if k % tp:
        raise UnsupportedError(f"{name}: {k} input features cannot be split over tp={tp}")
    part = k // tp
    s, e = rank * part, (rank + 1) * part
    if isinstance(w, IntWeight):
        if w.g_idx is not None or w.group_size in (-1, 0):
            scales, zeros, mins = w.scales, w.zeros, w.mins  # replicated on every rank
            g_idx = None if w.g_idx is None else w.g_idx[s:e]
        else:
            gs = w.group_size
            if s % gs or part % gs:
                raise UnsupportedError(
                    f"{name}: group size {gs} does not divide the per-rank input features {part} (tp={tp})"
                )
            scales = w.scales[s // gs : e // gs]
            zeros = None if w.zeros is None else w.zeros[s // gs : e // gs]
            mins = None if w.mins is None else w.mins[s // gs : e // gs]
            g_idx = None
        return dataclasses.replace(
            w, codes=w.codes[:, s:e], scales=scales, zeros=zeros, g_idx=g_idx, mins=mins
        )
    if isinstance(w, Fp8Weight):
        scale = w.scale
        if w.strategy == "block":
            assert w.block_size is not None
            bk = w.block_size[1]
            if s % bk or part % bk:
                raise UnsupportedError(
                    f"{name}: FP8 block size {bk} does not divide the per-rank input features "
                    f"{part} (tp={tp})"
                )
            scale = w.scale[:, s // bk : e // bk]
        return Fp8Weight(w.weight[:, s:e], scale, w.strategy, w.block_size, w.shard_sizes, w.bias)
    if isinstance(w, Fp4Weight):
        gs = w.group_size
        if s % gs or part % gs:
            raise UnsupportedError(
                f"{name}: {w.fmt} groups of {gs} do not divide the per-rank input features {part} (tp={tp})"
            )
        return Fp4Weight(
            w.codes[:, s:e], w.scales[:, s // gs : e // gs], w.fmt, w.global_scale, w.shard_sizes, w.bias
        )
    return DenseWeight(w.weight[:, s:e], w.bias)


def fuse(parts: list[SourceWeight], names: list[str]) -> SourceWeight:
    """Concatenate per-rank shard weights along N into one fused weight (q|k|v, gate|up)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    bias = _fuse_bias(parts, names)
    if all(isinstance(p, IntWeight) for p in parts):
        ints: list[IntWeight] = parts  # type: ignore[assignment]
        for p, name in zip(ints[1:], names[1:], strict=True):
            same_g = (p.g_idx is None and ints[0].g_idx is None) or (
                p.g_idx is not None and ints[0].g_idx is not None and torch.equal(p.g_idx, ints[0].g_idx)
            )
            if not same_g:
                raise ConversionError(
                    f"shards {names[0]} and {name} have different act-order g_idx; a fused layer needs one "
                    "input-channel order (re-quantize them with the same activation order)"
                )
            if (p.zeros is None) != (ints[0].zeros is None) or (p.mins is None) != (ints[0].mins is None):
                raise ConversionError(f"shards {names[0]} and {name} disagree on zero points")
            if not _same_codebook(p.codebook, ints[0].codebook):
                raise ConversionError(
                    f"shards {names[0]} and {name} have different value tables (quant_map); a fused layer "
                    "needs one (re-quantize them with the same bitsandbytes quant type)"
                )
        return dataclasses.replace(
            ints[0],
            codes=torch.cat([p.codes for p in ints]),
            scales=torch.cat([p.scales for p in ints], dim=1),
            zeros=None if ints[0].zeros is None else torch.cat([p.zeros for p in ints], dim=1),  # type: ignore[misc]
            bias=bias,
            mins=None if ints[0].mins is None else torch.cat([p.mins for p in ints], dim=1),  # type: ignore[misc]
        )
    if all(isinstance(p, Fp8Weight) for p in parts):
        fps: list[Fp8Weight] = parts  # type: ignore[assignment]
        weight = torch.cat([p.weight for p in fps])
        if fps[0].strategy == "tensor":
            scale = torch.cat([p.scale.reshape(-1) for p in fps])
            return Fp8Weight(weight, scale, "tensor", None, tuple(p.weight.shape[0] for p in fps), bias)
        if fps[0].strategy == "block":
            assert fps[0].block_size is not None
            bn = fps[0].block_size[0]
            for p, name in zip(fps[:-1], names[:-1], strict=True):
                if p.weight.shape[0] % bn:
                    raise UnsupportedError(
                        f"{name}: {p.weight.shape[0]} output rows per rank is not a multiple of the "
                        f"FP8 block {bn}, so it cannot be fused with the next shard"
                    )
        return Fp8Weight(
            weight, torch.cat([p.scale for p in fps]), fps[0].strategy, fps[0].block_size, (), bias
        )
    if all(isinstance(p, Fp4Weight) for p in parts):
        fp4s: list[Fp4Weight] = parts  # type: ignore[assignment]
        if any(p.fmt != fp4s[0].fmt for p in fp4s):
            raise ConversionError(f"shards {', '.join(names)} mix FP4 encodings")
        globals_ = [p.global_scale for p in fp4s]
        return Fp4Weight(
            torch.cat([p.codes for p in fp4s]),
            torch.cat([p.scales for p in fp4s]),
            fp4s[0].fmt,
            None if any(g is None for g in globals_) else torch.cat([g.reshape(-1) for g in globals_]),  # type: ignore[union-attr]
            tuple(p.codes.shape[0] for p in fp4s),
            bias,
        )
    if all(isinstance(p, DenseWeight) for p in parts):
        return DenseWeight(cat_rows([p.weight for p in parts]), bias)  # type: ignore[union-attr]
    raise ConversionError(
        f"shards {', '.join(names)} have different weight kinds ({type(first).__name__} ...)"
    )


def _fuse_bias(parts: list[SourceWeight], names: list[str]) -> torch.Tensor | None:
    have = [p.bias is not None for p in parts]
    if not any(have):
        return None
    if not all(have):
        missing = [n for n, h in zip(names, have, strict=True) if not h]
        raise ConversionError(f"some shards of a fused layer have a bias and {', '.join(missing)} do not")
    return cat_rows([p.bias for p in parts])  # type: ignore[misc]


def cat_rows(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0, without a copy when the tensors already lie back to back in one
    buffer (the checkpoint reader lays a layer's shards out that way)."""
    first = ts[0]
    pos = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for t in ts:
        if (
            t.dtype != first.dtype
            or t.dim() == 0
            or t.shape[1:] != first.shape[1:]
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.data_ptr() != pos
        ):
            return torch.cat(ts)
        pos += t.numel() * t.element_size()
    shape = (sum(t.shape[0] for t in ts), *first.shape[1:])
    return first.as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())


def interleave_halves(w: SourceWeight, name: str) -> SourceWeight:
    """A fused gate|up weight (gate rows, then as many up rows) with its rows interleaved: gate row j
    at 2j, up row j at 2j + 1 (gpt-oss's w13, as its checkpoints and vLLM's layers hold it)."""
    n = weight_shape(w)[0]
    order = torch.arange(n).view(2, n // 2).T.reshape(-1)  # (N,): 0, N/2, 1, N/2 + 1, ...
    bias = None if w.bias is None else w.bias[order]

    def one_scale(scale: torch.Tensor | None, what: str) -> torch.Tensor | None:
        """gate's and up's per-shard scale, which interleaving leaves as one for both."""
        if scale is None or scale.numel() == 1:
            return scale
        flat = scale.reshape(-1)
        if not bool((flat == flat[0]).all()):
            raise UnsupportedError(
                f"{name}: gate and up have different {what} ({flat.tolist()}); interleaved gate/up rows "
                "take one for both"
            )
        return flat[:1]

    if isinstance(w, IntWeight):
        return dataclasses.replace(w.rows(order), bias=bias)
    if isinstance(w, Fp8Weight):
        if w.strategy == "block":
            raise UnsupportedError(f"{name}: FP8 block scales cannot follow gate/up rows interleaved")
        scale = w.scale[order] if w.strategy == "channel" else one_scale(w.scale, "FP8 scales")
        assert scale is not None
        return Fp8Weight(w.weight[order], scale, w.strategy, None, (), bias)
    if isinstance(w, Fp4Weight):
        glob = one_scale(w.global_scale, "NVFP4 global scales")
        return Fp4Weight(w.codes[order], w.scales[order], w.fmt, glob, (), bias)
    return DenseWeight(w.weight[order], bias)


def pad_weight(w: SourceWeight, n: int, k: int, name: str) -> SourceWeight:
    """`w` (N, K) with zero rows and columns appended up to (n, k): codes 0 and E8M0 scale bytes 0 for
    FP4 (what vLLM's zero-initialised padded parameters hold), zeros for a dense weight; the bias
    padded with zeros."""
    n0, k0 = weight_shape(w)
    if (n0, k0) == (n, k):
        return w
    bias = None if w.bias is None else torch.nn.functional.pad(w.bias, (0, n - n0))
    if isinstance(w, Fp4Weight) and w.global_scale is None:
        gs = w.group_size
        if k0 % gs or k % gs:
            raise UnsupportedError(f"{name}: {w.fmt} groups of {gs} do not divide K={k0} padded to {k}")
        codes = torch.nn.functional.pad(w.codes, (0, k - k0, 0, n - n0))
        scales = torch.nn.functional.pad(w.scales, (0, (k - k0) // gs, 0, n - n0))
        return Fp4Weight(codes, scales, w.fmt, None, (), bias)
    if isinstance(w, DenseWeight):
        return DenseWeight(torch.nn.functional.pad(w.weight, (0, k - k0, 0, n - n0)), bias)
    raise UnsupportedError(f"{name}: a {type(w).__name__} is not padded by any layout (only MXFP4 experts)")


def _same_codebook(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
