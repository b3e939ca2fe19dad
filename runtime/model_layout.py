"""The model layout: which architectures Kiln runs, their config, and their linear layers as stored.

One home for these facts, read by the converter (planning, TP slicing), the loader (checking an
artifact before serving) and the model code. The Llama family: Llama 2/3, Mistral, Qwen2, SmolLM2.

Checkpoints keep unfused names (q_proj, k_proj, ...); artifacts use the runtime's fused names
(`self_attn.qkv_proj` = q|k|v, `mlp.gate_up_proj` = gate|up), as vLLM's packed_modules_mapping.
Column-parallel layers split output features across TP ranks: q by attention heads, k/v by KV heads
(replicated when kv_heads < tp: rank r holds KV head r // (tp // kv_heads)), gate/up evenly.
Row-parallel layers (o_proj, down_proj) split input features. lm_head, embeddings and norms are
replicated on every rank (the vocabulary is not sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels.errors import KilnError, UnsupportedError

# vLLM layer class names (compressed-tensors targets may name a class, matched case-insensitively).
CLASS_QKV = "QKVParallelLinear"
CLASS_MERGED = "MergedColumnParallelLinear"
CLASS_ROW = "RowParallelLinear"
CLASS_LM_HEAD = "ParallelLMHead"
_DIMENSIONS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
}


class ModelConfigError(KilnError):
    """config.json lacks a model dimension or has one of the wrong type."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None  # Mistral v0.1 (and Qwen2 with use_sliding_window)
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype (config `torch_dtype` / `dtype`)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str | None = None) -> ModelConfig:
        """Parse a Hugging Face config.json; `architecture` overrides its `architectures[0]`."""
        archs = cfg.get("architectures")
        arch = architecture or (archs[0] if isinstance(archs, list) and archs else cfg.get("model_type"))
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise UnsupportedError(f"architecture {arch!r} is not supported; supported: {supported}")
        try:
            return cls._parse(cfg, arch)
        except KeyError as e:
            raise ModelConfigError(f"config.json is missing {e.args[0]!r}") from e
        except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as e:
            raise ModelConfigError(
                f"config.json has a malformed model dimension ({e}); hidden_size, intermediate_size, "
                "num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim and vocab_size "
                "must be positive integers"
            ) from e

    @classmethod
    def _parse(cls, cfg: dict[str, Any], arch: str) -> ModelConfig:
        dims = {field: _positive(cfg[key], key) for field, key in _DIMENSIONS.items()}
        heads, hidden = dims["num_heads"], dims["hidden_size"]
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = rope or cfg.get("rope_scaling") or None
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
        family = ARCHITECTURES[arch]
        windowed = family.sliding_window or bool(cfg.get("use_sliding_window"))
        return cls(
            architecture=arch,
            **dims,
            num_kv_heads=_positive(cfg.get("num_key_value_heads") or heads, "num_key_value_heads"),
            head_dim=_positive(cfg.get("head_dim") or hidden // heads, "head_dim"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bool(cfg.get("attention_bias", False)),
            sliding_window=cfg.get("sliding_window") if windowed else None,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )


def _positive(value: Any, key: str) -> int:
    number = int(value)
    if number <= 0 or isinstance(value, bool):
        raise ValueError(f"{key} = {value!r}")
    return number


@dataclass(frozen=True)
class ShardLayout:
    module: str  # checkpoint module name, e.g. model.layers.0.self_attn.k_proj
    size: int  # output features (whole layer)
    heads: int = 0  # attention heads in this shard (q/k/v), 0 otherwise
    replicable: bool = False  # KV heads: copied to several ranks when there are fewer than tp


@dataclass(frozen=True)
class LinearLayout:
    name: str  # runtime (fused) name
    shards: tuple[ShardLayout, ...]
    k: int  # input features (whole layer)
    row_parallel: bool
    layer_class: str  # vLLM class name (for compressed-tensors class targets)
    decoder_layer: int | None  # index, or None for lm_head

    @property
    def n(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def fused(self) -> bool:
        return len(self.shards) > 1


def llama_decoder_linears(cfg: ModelConfig, layer: int) -> list[LinearLayout]:
    """A Llama-family decoder layer: fused q|k|v, o, fused gate|up, down."""
    hd, h, i = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    attn = f"model.layers.{layer}.self_attn"
    mlp = f"model.layers.{layer}.mlp"
    qkv = (
        ShardLayout(f"{attn}.q_proj", cfg.num_heads * hd, cfg.num_heads),
        ShardLayout(f"{attn}.k_proj", cfg.num_kv_heads * hd, cfg.num_kv_heads, replicable=True),
        ShardLayout(f"{attn}.v_proj", cfg.num_kv_heads * hd, cfg.num_kv_heads, replicable=True),
    )
    return [
        LinearLayout(f"{attn}.qkv_proj", qkv, h, False, CLASS_QKV, layer),
        LinearLayout(
            f"{attn}.o_proj", (ShardLayout(f"{attn}.o_proj", h),), cfg.num_heads * hd, True, CLASS_ROW, layer
        ),
        LinearLayout(
            f"{mlp}.gate_up_proj",
            (ShardLayout(f"{mlp}.gate_proj", i), ShardLayout(f"{mlp}.up_proj", i)),
            h,
            False,
            CLASS_MERGED,
            layer,
        ),
        LinearLayout(f"{mlp}.down_proj", (ShardLayout(f"{mlp}.down_proj", h),), i, True, CLASS_ROW, layer),
    ]


@dataclass(frozen=True)
class Architecture:
    """What differs between the supported architectures: a new one (or a new kind of layer, such as
    mixture-of-experts blocks) is an entry in ARCHITECTURES, with its own `decoder_linears`."""

    name: str
    qkv_bias: bool = False  # q/k/v projections always carry a bias
    sliding_window: bool = False  # the config's sliding_window always applies
    decoder_linears: Callable[[ModelConfig, int], list[LinearLayout]] = llama_decoder_linears


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM"),
        Architecture("MistralForCausalLM", sliding_window=True),
        Architecture("Qwen2ForCausalLM", qkv_bias=True),
    )
}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)


def linear_layouts(cfg: ModelConfig, has_lm_head: bool) -> list[LinearLayout]:
    """Every linear layer in execution order: each decoder layer's, then lm_head."""
    decoder_linears = ARCHITECTURES[cfg.architecture].decoder_linears
    out = [lin for layer in range(cfg.num_layers) for lin in decoder_linears(cfg, layer)]
    if has_lm_head:
        lm_head = ShardLayout("lm_head", cfg.vocab_size)
        out.append(LinearLayout("lm_head", (lm_head,), cfg.hidden_size, False, CLASS_LM_HEAD, None))
    return out


@dataclass(frozen=True)
class RowRange:
    start: int
    size: int


def shard_rows(shard: ShardLayout, layout: LinearLayout, cfg: ModelConfig, rank: int, tp: int) -> RowRange:
    """Output rows of one shard of a column-parallel (or replicated) layer that rank `rank` holds."""
    if tp == 1 or layout.decoder_layer is None or layout.row_parallel:
        return RowRange(0, shard.size)
    if shard.heads:
        head = cfg.head_dim
        heads = shard.heads
        if heads >= tp or not shard.replicable:
            if heads % tp:
                raise UnsupportedError(f"{shard.module}: {heads} heads cannot be split over tp={tp}")
            per = heads // tp
            return RowRange(rank * per * head, per * head)
        if tp % heads:
            raise UnsupportedError(f"{shard.module}: {heads} KV heads cannot be replicated over tp={tp}")
        return RowRange((rank // (tp // heads)) * head, head)
    if shard.size % tp:
        raise UnsupportedError(f"{shard.module}: {shard.size} output features cannot be split over tp={tp}")
    per = shard.size // tp
    return RowRange(rank * per, per)


@dataclass(frozen=True)
class RankShape:
    """A linear layer's shape on one TP rank: output features per shard, and input features."""

    shard_sizes: tuple[int, ...]
    k: int

    @property
    def n(self) -> int:
        return sum(self.shard_sizes)


def rank_shape(layout: LinearLayout, cfg: ModelConfig, rank: int, tp: int) -> RankShape:
    if layout.row_parallel and tp > 1:
        if layout.k % tp:
            raise UnsupportedError(f"{layout.name}: K={layout.k} input features cannot be split over tp={tp}")
        return RankShape(tuple(s.size for s in layout.shards), layout.k // tp)
    return RankShape(tuple(shard_rows(s, layout, cfg, rank, tp).size for s in layout.shards), layout.k)
