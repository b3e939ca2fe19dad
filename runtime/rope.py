"""Rotary position embeddings: the inverse frequencies of every rope scaling Kiln runs (default,
llama3, linear, dynamic NTK, YaRN with its attention factor), the cos / sin tables and their
application (neox style: the two halves of each rotated width; interleaved pairs are de-interleaved
first by the caller, which leaves every q·k product unchanged)."""

from __future__ import annotations

import math

import torch

from kernels.errors import UnsupportedError
from runtime.model_layout import ModelConfig, ModelConfigError


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1.0 for every other rope): its `attention_factor`, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), else mscale(factor)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(scaling: dict, dim: int, base: float, max_positions: int) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) below the `beta_slow` rotations, extrapolated (kept)
    above `beta_fast`, a linear ramp between; the band from the original context length."""
    factor = float(scaling["factor"])
    orig = float(scaling.get("original_max_position_embeddings") or max_positions)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_inv_freq(cfg: ModelConfig, max_len: int) -> torch.Tensor:
    """(rope_dim // 2,) float64 inverse frequencies, rope scaling applied."""
    dim = cfg.rope_dim
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
    if kind == "yarn":
        return _yarn_inv_freq(scaling, dim, base, cfg.max_position_embeddings)
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
        f"rope_scaling type {kind!r} is not supported (supported: llama3, linear, dynamic, yarn)"
    )


def check_rope(cfg: ModelConfig) -> None:
    """The rotary frequencies this config gives (up to its longest context) are computable, finite
    and positive in fp32: UnsupportedError for a rope scaling kind this model lacks, ModelConfigError for
    values that together give NaN, infinite or zero frequencies."""
    try:
        inv_freq = rope_inv_freq(cfg, cfg.max_position_embeddings).float()  # as rope_tables uses them
    except (ZeroDivisionError, OverflowError) as e:
        raise ModelConfigError(
            f"rope_theta = {cfg.rope_theta} with rope scaling {cfg.rope_scaling} and a rotated width of "
            f"{cfg.rope_dim}: the rotary frequencies cannot be computed ({e}); the model config is "
            "corrupt or was altered — re-convert the checkpoint"
        ) from e
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        raise ModelConfigError(
            f"rope_theta = {cfg.rope_theta} with rope scaling {cfg.rope_scaling} gives non-finite or "
            "zero rotary frequencies; the model config is corrupt or was altered — re-convert the checkpoint"
        )


def rope_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_len, rope_dim // 2), times YaRN's attention factor."""
    inv_freq = rope_inv_freq(cfg, max_len).float()
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    factor = rope_attention_factor(cfg)
    return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)


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
