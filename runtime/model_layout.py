"""The model layout: which architectures Kiln runs, their config, and their linear layers as stored.

One home for these facts, read by the converter (planning, TP slicing), the loader (checking an
artifact before serving) and the model code. The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2),
Qwen3 (per-head q/k RMSNorm) and the mixture-of-experts Qwen3-MoE and Mixtral.

Mixture-of-experts layers have a router (`mlp.gate` / `block_sparse_moe.gate`, a replicated linear
layer of E outputs) and an expert group (`ExpertGroupLayout`): every expert's gate, up and down
projections, which artifacts store stacked as `w13` (gate then up) and `w2` (down), like vLLM's
FusedMoE. Under TP each expert's intermediate dimension is split (w13 column-, w2 row-parallel);
under expert parallelism (EP = TP ranks) each rank holds E / tp whole experts.

Checkpoints keep unfused names (q_proj, k_proj, ...); artifacts use the runtime's fused names
(`self_attn.qkv_proj` = q|k|v, `mlp.gate_up_proj` = gate|up), as vLLM's packed_modules_mapping.
Column-parallel layers split output features across TP ranks: q by attention heads, k/v by KV heads
(replicated when kv_heads < tp: rank r holds KV head r // (tp // kv_heads)), gate/up evenly.
Row-parallel layers (o_proj, down_proj) split input features. lm_head, embeddings and norms are
replicated on every rank (the vocabulary is not sharded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kernels.errors import KilnError, UnsupportedError

# vLLM layer class names (compressed-tensors targets may name a class, matched case-insensitively).
CLASS_QKV = "QKVParallelLinear"
CLASS_MERGED = "MergedColumnParallelLinear"
CLASS_ROW = "RowParallelLinear"
CLASS_LM_HEAD = "ParallelLMHead"
CLASS_REPLICATED = "ReplicatedLinear"
CLASS_EXPERT = "Linear"  # experts are plain Linears in checkpoints (llm-compressor targets "Linear")
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
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    moe: MoEConfig | None = None  # mixture-of-experts layers, if any

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.applies_to(layer)

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
        moe = family.experts.parse(cfg, dims["num_layers"]) if family.experts is not None else None
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
            qk_norm=family.qk_norm,
            moe=moe,
        )


@dataclass(frozen=True)
class MoEConfig:
    """The expert layers of a mixture-of-experts model, from its config.json."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k routing weights rescaled to sum to 1
    sparse_step: int = 1  # every sparse_step-th layer is an expert layer (Qwen MoE)
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead (mlp_only_layers)

    def applies_to(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


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
    replicated: bool = False  # every rank holds the whole layer (lm_head, MoE routers)

    @property
    def n(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def fused(self) -> bool:
        return len(self.shards) > 1


def attention_linears(cfg: ModelConfig, layer: int) -> list[LinearLayout]:
    """Fused q|k|v and o of one decoder layer."""
    hd, h = cfg.head_dim, cfg.hidden_size
    attn = f"model.layers.{layer}.self_attn"
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
    ]


def mlp_linears(cfg: ModelConfig, layer: int) -> list[LinearLayout]:
    """A dense SwiGLU MLP: fused gate|up, down."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    mlp = f"model.layers.{layer}.mlp"
    return [
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


def llama_decoder_linears(cfg: ModelConfig, layer: int) -> list[LinearLayout]:
    """A Llama-family decoder layer: fused q|k|v, o, fused gate|up, down."""
    return [*attention_linears(cfg, layer), *mlp_linears(cfg, layer)]


@dataclass(frozen=True)
class ExpertGroupLayout:
    """The experts of one MoE layer, as checkpoints name them and artifacts store them (stacked)."""

    name: str  # runtime name, e.g. model.layers.3.mlp.experts
    expert_prefix: str  # checkpoint module of expert e: expert_prefix.format(e=e)
    parts: tuple[str, str, str]  # module names of gate, up, down inside an expert
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # per expert, whole
    decoder_layer: int
    alternatives: tuple[tuple[str, str, str], ...] = ()  # other names checkpoints give the parts

    def named(self, parts: tuple[str, str, str]) -> ExpertGroupLayout:
        """The same group with the experts' projections named `parts` (see ExpertNaming.parts)."""
        return dataclasses.replace(self, parts=parts)

    def module(self, expert: int, part: int) -> str:
        """Checkpoint module of an expert's gate (0), up (1) or down (2) projection."""
        return f"{self.expert_prefix.format(e=expert)}.{self.parts[part]}"

    def w13(self, expert: int) -> LinearLayout:
        """One expert's fused gate|up, as a linear layer (its TP split is the expert group's)."""
        i = self.intermediate
        shards = (ShardLayout(self.module(expert, 0), i), ShardLayout(self.module(expert, 1), i))
        return LinearLayout(f"{self.name}.w13", shards, self.hidden, False, CLASS_EXPERT, self.decoder_layer)

    def w2(self, expert: int) -> LinearLayout:
        down = (ShardLayout(self.module(expert, 2), self.hidden),)
        return LinearLayout(
            f"{self.name}.w2", down, self.intermediate, True, CLASS_EXPERT, self.decoder_layer
        )


@dataclass(frozen=True)
class ExpertNaming:
    """How an architecture's MoE layers are named and configured."""

    block: str  # "mlp" (Qwen MoE) or "block_sparse_moe" (Mixtral)
    # gate, up, down module names inside an expert; alternatives after the first (llm-compressor
    # writes Mixtral's w1 / w3 / w2 as gate_proj / up_proj / down_proj) are tried by the converter
    parts: tuple[tuple[str, str, str], ...]
    num_experts_keys: tuple[str, ...]  # the first present one counts (transformers renamed some)
    intermediate_key: str
    renormalize_key: str | None  # None: always renormalize (Mixtral's softmax over the top k)
    renormalize_default: bool = False

    def parse(self, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
        experts = int(next((cfg[k] for k in self.num_experts_keys if cfg.get(k)), 0))
        if experts <= 0:
            return None
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ValueError(f"mlp_only_layers = {dense!r}")
        renormalize = (
            True
            if self.renormalize_key is None
            else bool(cfg.get(self.renormalize_key, self.renormalize_default))
        )
        return MoEConfig(
            num_experts=experts,
            top_k=_positive(cfg["num_experts_per_tok"], "num_experts_per_tok"),
            intermediate_size=_positive(cfg[self.intermediate_key], self.intermediate_key),
            renormalize=renormalize,
            sparse_step=_positive(cfg.get("decoder_sparse_step") or 1, "decoder_sparse_step"),
            dense_layers=frozenset(i for i in dense if 0 <= i < num_layers),
        )

    def router(self, cfg: ModelConfig, layer: int) -> LinearLayout:
        assert cfg.moe is not None
        name = f"model.layers.{layer}.{self.block}.gate"
        shard = (ShardLayout(name, cfg.moe.num_experts),)
        return LinearLayout(name, shard, cfg.hidden_size, False, CLASS_REPLICATED, layer, replicated=True)

    def group(self, cfg: ModelConfig, layer: int) -> ExpertGroupLayout:
        assert cfg.moe is not None
        block = f"model.layers.{layer}.{self.block}"
        return ExpertGroupLayout(
            name=f"{block}.experts",
            expert_prefix=block + ".experts.{e}",
            parts=self.parts[0],
            alternatives=self.parts[1:],
            num_experts=cfg.moe.num_experts,
            top_k=cfg.moe.top_k,
            hidden=cfg.hidden_size,
            intermediate=cfg.moe.intermediate_size,
            decoder_layer=layer,
        )


@dataclass(frozen=True)
class Architecture:
    """What differs between the supported architectures: a new one is an entry in ARCHITECTURES."""

    name: str
    qkv_bias: bool = False  # q/k/v projections always carry a bias
    sliding_window: bool = False  # the config's sliding_window always applies
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    experts: ExpertNaming | None = None  # mixture-of-experts layers

    def decoder_linears(self, cfg: ModelConfig, layer: int) -> list[LinearLayout]:
        """The linear layers of one decoder layer, in execution order (an MoE layer: its router)."""
        if self.experts is not None and cfg.is_moe_layer(layer):
            return [*attention_linears(cfg, layer), self.experts.router(cfg, layer)]
        return llama_decoder_linears(cfg, layer)

    def expert_group(self, cfg: ModelConfig, layer: int) -> ExpertGroupLayout | None:
        if self.experts is None or not cfg.is_moe_layer(layer):
            return None
        return self.experts.group(cfg, layer)


QWEN_MOE = ExpertNaming(
    block="mlp",
    parts=(("gate_proj", "up_proj", "down_proj"),),
    num_experts_keys=("num_experts", "num_local_experts"),  # transformers 4 / 5
    intermediate_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
)
MIXTRAL_MOE = ExpertNaming(
    block="block_sparse_moe",
    parts=(("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")),
    num_experts_keys=("num_local_experts",),
    intermediate_key="intermediate_size",
    renormalize_key=None,
)
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM"),
        Architecture("MistralForCausalLM", sliding_window=True),
        Architecture("Qwen2ForCausalLM", qkv_bias=True),
        Architecture("Qwen3ForCausalLM", qk_norm=True),
        Architecture("Qwen3MoeForCausalLM", qk_norm=True, experts=QWEN_MOE),
        Architecture("MixtralForCausalLM", sliding_window=True, experts=MIXTRAL_MOE),
    )
}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)


def linear_layouts(cfg: ModelConfig, has_lm_head: bool) -> list[LinearLayout]:
    """Every linear layer in execution order: each decoder layer's, then lm_head."""
    arch = ARCHITECTURES[cfg.architecture]
    out = [lin for layer in range(cfg.num_layers) for lin in arch.decoder_linears(cfg, layer)]
    if has_lm_head:
        lm_head = ShardLayout("lm_head", cfg.vocab_size)
        out.append(
            LinearLayout("lm_head", (lm_head,), cfg.hidden_size, False, CLASS_LM_HEAD, None, replicated=True)
        )
    return out


def expert_groups(cfg: ModelConfig) -> list[ExpertGroupLayout]:
    """Every MoE layer's expert group, in layer order."""
    arch = ARCHITECTURES[cfg.architecture]
    groups = (arch.expert_group(cfg, layer) for layer in range(cfg.num_layers))
    return [g for g in groups if g is not None]


@dataclass(frozen=True)
class RowRange:
    start: int
    size: int


def shard_rows(shard: ShardLayout, layout: LinearLayout, cfg: ModelConfig, rank: int, tp: int) -> RowRange:
    """Output rows of one shard of a column-parallel (or replicated) layer that rank `rank` holds."""
    if tp == 1 or layout.replicated or layout.row_parallel:
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


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts a rank holds and how much of each: EP gives whole experts, TP a slice of each."""

    first_expert: int
    num_experts: int
    intermediate: int  # per expert on this rank
    intermediate_start: int  # first intermediate row / column of this rank's slice


def expert_placement(group: ExpertGroupLayout, rank: int, tp: int, expert_parallel: bool) -> ExpertPlacement:
    if tp == 1:
        return ExpertPlacement(0, group.num_experts, group.intermediate, 0)
    if expert_parallel:
        if group.num_experts % tp:
            raise UnsupportedError(
                f"{group.name}: {group.num_experts} experts cannot be placed evenly on {tp} ranks (--ep)"
            )
        per = group.num_experts // tp
        return ExpertPlacement(rank * per, per, group.intermediate, 0)
    if group.intermediate % tp:
        raise UnsupportedError(
            f"{group.name}: expert intermediate size {group.intermediate} cannot be split over tp={tp}; "
            "use expert parallelism (--ep) or another tp"
        )
    per = group.intermediate // tp
    return ExpertPlacement(0, group.num_experts, per, rank * per)
