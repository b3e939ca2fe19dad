"""The Llama-family module layout the converter plans over (Llama 2/3, Mistral, Qwen2, SmolLM2).

Checkpoints keep unfused names (q_proj, k_proj, ...); artifacts use the runtime's fused names
(`self_attn.qkv_proj` = q|k|v, `mlp.gate_up_proj` = gate|up), as vLLM's packed_modules_mapping.
Column-parallel layers split output features across TP ranks, row-parallel ones input features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.convert.errors import ConversionError, UnsupportedError

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
# vLLM layer class names (compressed-tensors targets may name a class, matched case-insensitively).
CLASS_QKV = "QKVParallelLinear"
CLASS_MERGED = "MergedColumnParallelLinear"
CLASS_ROW = "RowParallelLinear"
CLASS_LM_HEAD = "ParallelLMHead"


@dataclass(frozen=True)
class ModelDims:
    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_word_embeddings: bool
    torch_dtype: str

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelDims:
        archs = config.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else config.get("model_type", "?")
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise UnsupportedError(f"architecture {arch!r} is not supported; supported: {supported}")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            dims = cls(
                architecture=arch,
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            )
        except KeyError as e:
            raise ConversionError(f"config.json is missing {e.args[0]!r}") from e
        except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            raise ConversionError(
                f"config.json has a malformed model dimension ({e}); hidden_size, intermediate_size, "
                "num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim and vocab_size "
                "must be positive integers"
            ) from e
        return dims


@dataclass(frozen=True)
class ShardLayout:
    module: str  # checkpoint module name, e.g. model.layers.0.self_attn.k_proj
    size: int  # output features (whole layer)
    heads: int = 0  # attention heads in this shard (q/k/v), 0 otherwise


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


def linear_layouts(dims: ModelDims, has_lm_head: bool) -> list[LinearLayout]:
    """Every linear layer in execution order: per decoder layer qkv, o, gate_up, down; then lm_head."""
    out: list[LinearLayout] = []
    hd, h, i = dims.head_dim, dims.hidden, dims.intermediate
    for layer in range(dims.layers):
        attn = f"model.layers.{layer}.self_attn"
        mlp = f"model.layers.{layer}.mlp"
        out.append(
            LinearLayout(
                f"{attn}.qkv_proj",
                (
                    ShardLayout(f"{attn}.q_proj", dims.heads * hd, dims.heads),
                    ShardLayout(f"{attn}.k_proj", dims.kv_heads * hd, dims.kv_heads),
                    ShardLayout(f"{attn}.v_proj", dims.kv_heads * hd, dims.kv_heads),
                ),
                h,
                False,
                CLASS_QKV,
                layer,
            )
        )
        out.append(
            LinearLayout(
                f"{attn}.o_proj", (ShardLayout(f"{attn}.o_proj", h),), dims.heads * hd, True, CLASS_ROW, layer
            )
        )
        out.append(
            LinearLayout(
                f"{mlp}.gate_up_proj",
                (ShardLayout(f"{mlp}.gate_proj", i), ShardLayout(f"{mlp}.up_proj", i)),
                h,
                False,
                CLASS_MERGED,
                layer,
            )
        )
        out.append(
            LinearLayout(f"{mlp}.down_proj", (ShardLayout(f"{mlp}.down_proj", h),), i, True, CLASS_ROW, layer)
        )
    if has_lm_head:
        out.append(
            LinearLayout("lm_head", (ShardLayout("lm_head", dims.vocab),), h, False, CLASS_LM_HEAD, None)
        )
    return out
