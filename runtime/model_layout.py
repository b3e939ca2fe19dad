"""The model layout: which architectures Kiln runs, their config, and their linear layers as stored.

One home for these facts, read by the converter (planning, TP slicing), the loader (checking an
artifact before serving) and the model code. The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2),
Qwen3 (per-head q/k RMSNorm), the mixture-of-experts Qwen2-MoE, Qwen3-MoE and Mixtral, and
DeepSeek-V2/V3 (multi-head latent attention, `MlaConfig`; grouped routing, `Routing`; shared experts)
and gpt-oss (attention sinks, sliding-window attention on every other layer, biased experts with a
clamped SwiGLU over interleaved gate/up rows, `MoEConfig.activation`).

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
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernels.errors import KilnError, UnsupportedError
from kernels.moe_base import SILU, SWIGLU_OAI

# vLLM layer class names (compressed-tensors targets may name a class, matched case-insensitively).
CLASS_QKV = "QKVParallelLinear"
CLASS_MERGED = "MergedColumnParallelLinear"
CLASS_ROW = "RowParallelLinear"
CLASS_LM_HEAD = "ParallelLMHead"
CLASS_REPLICATED = "ReplicatedLinear"
CLASS_EXPERT = "Linear"  # experts are plain Linears in checkpoints (llm-compressor targets "Linear")
# Sanity bounds on a model config's values (far above any model Kiln runs). The tight bounds are the
# tensors: the loader checks the dimensions against the manifest's layers and the rank files'
# safetensors headers before it builds anything.
MAX_DIMENSION = 1 << 20  # hidden_size, intermediate_size, head_dim
MAX_VOCAB_SIZE = 1 << 22
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_POSITIONS = 1 << 26  # max_position_embeddings, sliding_window, rope's original context
MAX_EXPERTS = 1 << 14
MAX_ROPE_THETA = 1e12
MAX_ROPE_FACTOR = 1e6
MAX_ROUTED_SCALING = 1e6  # routed_scaling_factor (DeepSeek-V2: 16)
# The caps above by config.json field: what the converter (services/convert/limits.py) checks on a
# checkpoint's config before planning, and what the loader checks on a manifest's.
DIMENSION_CAPS: dict[str, int] = {
    "num_hidden_layers": MAX_LAYERS,
    "hidden_size": MAX_DIMENSION,
    "intermediate_size": MAX_DIMENSION,
    "moe_intermediate_size": MAX_DIMENSION,
    "shared_expert_intermediate_size": MAX_DIMENSION,
    "num_attention_heads": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS,
    "head_dim": MAX_DIMENSION,
    "vocab_size": MAX_VOCAB_SIZE,
    "num_experts": MAX_EXPERTS,
    "num_local_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS,
    "n_routed_experts": MAX_EXPERTS,
    "n_shared_experts": MAX_EXPERTS,
    "q_lora_rank": MAX_DIMENSION,
    "kv_lora_rank": MAX_DIMENSION,
    "qk_nope_head_dim": MAX_DIMENSION,
    "qk_rope_head_dim": MAX_DIMENSION,
    "v_head_dim": MAX_DIMENSION,
}
# Rope scaling kinds the model computes, with the keys each needs (runtime/model.py rope_inv_freq).
ROPE_SCALING_KEYS = {
    "llama3": ("factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
}
_DIMENSIONS = {
    "hidden_size": ("hidden_size", MAX_DIMENSION),
    "intermediate_size": ("intermediate_size", MAX_DIMENSION),
    "num_layers": ("num_hidden_layers", MAX_LAYERS),
    "num_heads": ("num_attention_heads", MAX_HEADS),
    "vocab_size": ("vocab_size", MAX_VOCAB_SIZE),
}


class ModelConfigError(KilnError):
    """The model config (config.json, or a manifest's hf_config) lacks a value, or has one of the
    wrong type or out of range."""


@dataclass(frozen=True)
class ConfigValues:
    """Typed reads of a model config's values: each refuses a wrong type, a non-finite number or a
    value out of range with a ModelConfigError naming where, the key and the value. Absent and null
    values take the default (or are an error when there is none)."""

    cfg: Mapping[str, Any]
    where: str  # "config.json", "manifest.json hf_config", ... (nested: "... rope_scaling")

    def error(self, key: str, value: Any, rule: str) -> ModelConfigError:
        shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
        return ModelConfigError(
            f"{self.where}: {key} = {shown[:80]}: {rule}; the model config is corrupt or was altered "
            "— re-convert the checkpoint"
        )

    def integer(self, key: str, hi: int, *, lo: int = 1, default: int | None = None) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(f"{self.where} is missing {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.error(key, value, f"must be an integer in [{lo}, {hi}]")
        return value

    def real(self, key: str, default: float, *, hi: float, hi_open: bool = False) -> float:
        """A finite number in (0, hi] (or (0, hi) when `hi_open`)."""
        value = self.cfg.get(key)
        if value is None:
            return default
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not (0 < value < hi if hi_open else 0 < value <= hi):
            raise self.error(key, value, f"must be a finite number in (0, {hi:g}{')' if hi_open else ']'}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, value, "must be true or false")
        return value

    def text(self, key: str) -> str | None:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, str):
            raise self.error(key, value, "must be a string")
        return value

    def mapping(self, key: str) -> ConfigValues | None:
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(key, value, "must be an object")
        return ConfigValues(value, f"{self.where} {key}")

    def finite_numbers(self) -> None:
        """Every number directly in this mapping is finite."""
        for key, value in self.cfg.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise self.error(key, value, "must be a finite number")


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
    mla: MlaConfig | None = None  # DeepSeek: multi-head latent attention instead of q/k/v heads
    extra_layers: int = 0  # layers stored after the last decoder layer and not run (DeepSeek MTP)
    # The layers `sliding_window` applies to: None, every layer (the engine caps the context at the
    # window, within which full attention is the same); else only these, masked in attention (gpt-oss)
    window_layers: frozenset[int] | None = None
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax's denominator

    def window(self, layer: int) -> int | None:
        """The sliding window attention masks at `layer` (None: full attention, or capped by the engine)."""
        if self.window_layers is None or layer not in self.window_layers:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.applies_to(layer)

    @property
    def rope_dim(self) -> int:
        """The rotated width of a head: MLA rotates only its decoupled rope part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], architecture: str | None = None, *, where: str = "config.json"
    ) -> ModelConfig:
        """Parse a Hugging Face config.json (`where` names it in errors); `architecture` overrides
        its `architectures[0]`. Every value read is checked for type, finiteness and range."""
        archs = cfg.get("architectures")
        arch = architecture or (archs[0] if isinstance(archs, list) and archs else cfg.get("model_type"))
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise UnsupportedError(f"architecture {arch!r} is not supported; supported: {supported}")
        return cls._parse(ConfigValues(cfg, where), arch)

    @classmethod
    def _parse(cls, read: ConfigValues, arch: str) -> ModelConfig:
        dims = {field: read.integer(key, hi) for field, (key, hi) in _DIMENSIONS.items()}
        heads, hidden = dims["num_heads"], dims["hidden_size"]
        if hidden % heads:
            raise read.error("num_attention_heads", heads, f"must divide hidden_size = {hidden}")
        kv_heads = read.integer("num_key_value_heads", heads, default=heads)
        if heads % kv_heads:
            raise read.error("num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
        head_dim = read.integer("head_dim", MAX_DIMENSION, default=hidden // heads)
        if head_dim % 2:
            raise read.error("head_dim", head_dim, "must be even (rotary embeddings rotate pairs)")
        # A context holds at least a prompt token and a generated one.
        max_positions = read.integer("max_position_embeddings", MAX_POSITIONS, lo=2, default=4096)
        theta, scaling = _rope(read)
        family = ARCHITECTURES[arch]
        windowed = family.sliding_window or family.layer_types or read.flag("use_sliding_window")
        window = read.integer("sliding_window", MAX_POSITIONS, lo=2, default=0) if windowed else 0
        window_layers = _window_layers(read, dims["num_layers"]) if family.layer_types and window else None
        moe = family.experts.parse(read, dims["num_layers"]) if family.experts is not None else None
        mla = MlaConfig.parse(read, interleaved_default=family.mla_interleaved) if family.mla else None
        if mla is not None:
            head_dim = mla.qk_rope_head_dim
        return cls(
            architecture=arch,
            **dims,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=read.real("rms_norm_eps", 1e-6, hi=1.0, hi_open=True),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=read.flag("tie_word_embeddings"),
            qkv_bias=family.qkv_bias or read.flag("attention_bias"),
            sliding_window=window or None,
            torch_dtype=read.text("torch_dtype") or read.text("dtype") or "bfloat16",
            qk_norm=family.qk_norm,
            moe=moe,
            mla=mla,
            extra_layers=read.integer("num_nextn_predict_layers", MAX_LAYERS, lo=0, default=0),
            window_layers=window_layers,
            attention_sinks=family.attention_sinks,
        )


LAYER_TYPES = ("sliding_attention", "full_attention")


def _window_layers(read: ConfigValues, num_layers: int) -> frozenset[int]:
    """The layers `layer_types` marks "sliding_attention"; without it, the even ones (gpt-oss's
    alternation, as transformers and vLLM default it)."""
    types = read.cfg.get("layer_types")
    if types is None:
        return frozenset(range(0, num_layers, 2))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise read.error("layer_types", types, f"must list {num_layers} of {' / '.join(LAYER_TYPES)}")
    return frozenset(i for i, t in enumerate(types) if t == "sliding_attention")


def _rope(read: ConfigValues) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the rope scaling (None for plain rope). transformers 5 keeps both in
    `rope_parameters`; 4.x in `rope_theta` + `rope_scaling`."""
    params = read.mapping("rope_parameters")
    if params is not None and "rope_theta" in params.cfg:
        theta = params.real("rope_theta", 10000.0, hi=MAX_ROPE_THETA)
    else:
        theta = read.real("rope_theta", 10000.0, hi=MAX_ROPE_THETA)
    rest = {k: v for k, v in params.cfg.items() if k != "rope_theta"} if params is not None else {}
    scaling = (
        ConfigValues(rest, params.where) if rest and params is not None else read.mapping("rope_scaling")
    )
    if scaling is None:
        return theta, None
    scaling.finite_numbers()
    kind = scaling.text("rope_type") or scaling.text("type") or "default"
    if kind == "default":
        return theta, None
    for key in ROPE_SCALING_KEYS.get(kind, ()):
        if scaling.cfg.get(key) is None:
            raise ModelConfigError(f"{scaling.where}: rope_type {kind!r} needs {key!r}, which is missing")
    if "factor" in scaling.cfg:
        scaling.real("factor", 1.0, hi=MAX_ROPE_FACTOR)
    if "original_max_position_embeddings" in scaling.cfg:
        scaling.integer("original_max_position_embeddings", MAX_POSITIONS)
    if kind == "llama3":
        low = scaling.real("low_freq_factor", 1.0, hi=MAX_ROPE_FACTOR)
        high = scaling.real("high_freq_factor", 4.0, hi=MAX_ROPE_FACTOR)
        if high <= low:
            raise scaling.error("high_freq_factor", high, f"must exceed low_freq_factor = {low}")
    return theta, {**{k: v for k, v in scaling.cfg.items() if v is not None}, "rope_type": kind}


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: q through a low-rank bottleneck (or a plain q_proj when
    q_lora_rank is null), keys and values from one compressed latent of kv_lora_rank plus a rope key
    of qk_rope_head_dim shared by every head. Per head: qk_nope_head_dim + qk_rope_head_dim query/key
    dims, v_head_dim value dims."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # rope pairs (x0, x1), (x2, x3), ... (GPT-J style), not the two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the KV cache holds per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def parse(cls, read: ConfigValues, *, interleaved_default: bool) -> MlaConfig:
        q_lora = read.cfg.get("q_lora_rank")
        rope = read.integer("qk_rope_head_dim", MAX_DIMENSION)
        if rope % 2:
            raise read.error("qk_rope_head_dim", rope, "must be even (rotary embeddings rotate pairs)")
        return cls(
            q_lora_rank=None if q_lora is None else read.integer("q_lora_rank", MAX_DIMENSION),
            kv_lora_rank=read.integer("kv_lora_rank", MAX_DIMENSION),
            qk_nope_head_dim=read.integer("qk_nope_head_dim", MAX_DIMENSION),
            qk_rope_head_dim=rope,
            v_head_dim=read.integer("v_head_dim", MAX_DIMENSION),
            rope_interleaved=read.flag("rope_interleave", interleaved_default),
        )

    def mha_kv_bytes_per_token(self, num_layers: int, num_heads: int, itemsize: int) -> int:
        """The same attention as plain multi-head keys and values (what an MHA cache would hold)."""
        return num_layers * num_heads * (self.qk_head_dim + self.v_head_dim) * itemsize


@dataclass(frozen=True)
class Routing:
    """How a router's logits become each token's experts and weights (softmax top-k by default).

    DeepSeek: sigmoid (V3) or softmax (V2) scores; group-limited choice (experts in `groups` equal
    groups, only the `topk_groups` best groups eligible, a group scored by its best expert or, with a
    correction bias, by the sum of its best two); V3's `e_score_correction_bias` added for the
    choice only; the chosen weights multiplied by `scaling`."""

    scoring: str = "softmax"  # softmax | sigmoid
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # max | top2 (sum of the best two)
    correction_bias: bool = False
    scaling: float = 1.0


SWIGLU_OAI_DEFAULT_LIMIT = 7.0  # gpt-oss configs without `swiglu_limit` (transformers' default)
MAX_SWIGLU_LIMIT = 1e4


@dataclass(frozen=True)
class MoEConfig:
    """The expert layers of a mixture-of-experts model, from its config.json."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k routing weights rescaled to sum to 1
    sparse_step: int = 1  # every sparse_step-th layer is an expert layer (Qwen MoE)
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead (mlp_only_layers)
    # Qwen2-MoE: a dense SwiGLU expert every token goes through, its output scaled by
    # sigmoid(shared_expert_gate(x)) (a (1, H) linear) and added to the routed experts' sum
    shared_expert_intermediate: int = 0
    routing: Routing = Routing()
    activation: str = SILU  # of the experts' gate|up (kernels.moe_base.EXPERT_ACTIVATIONS)
    swiglu_limit: float = 0.0  # swigluoai: the clamp of gate (above) and up (both sides)

    def applies_to(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


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
    replicated: bool = False  # every rank holds the whole layer (lm_head, MoE routers, MLA's latent)
    # lm_head, MoE routers and gates: left in the checkpoint's precision by online FP8 (and by
    # ModelOpt unless stored quantized), as vLLM leaves them
    full_precision: bool = False

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


def mlp_linears(
    cfg: ModelConfig, layer: int, mlp: str | None = None, intermediate: int | None = None
) -> list[LinearLayout]:
    """A dense SwiGLU MLP: fused gate|up, down (the decoder layer's `mlp` unless named)."""
    h, i = cfg.hidden_size, intermediate or cfg.intermediate_size
    mlp = mlp or f"model.layers.{layer}.mlp"
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
    shared_expert_key: str | None = None  # config key of a shared expert's size (Qwen2-MoE)
    shared_expert_name: str = "shared_expert"  # its module inside the block
    shared_expert_gated: bool = True  # Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x))
    # DeepSeek's config keys (routing, n_shared_experts, first_k_dense_replace), with the topk_method
    # its transformers model uses when the config names none; None for other families
    deepseek_topk_method: str | None = None
    router_name: str = "gate"  # the router's module inside the block (gpt-oss: "router")
    activation: str = SILU  # kernels.moe_base.EXPERT_ACTIVATIONS; swigluoai reads `swiglu_limit`

    def parse(self, read: ConfigValues, num_layers: int) -> MoEConfig | None:
        key = next((k for k in self.num_experts_keys if read.cfg.get(k)), None)
        experts = 0 if key is None else read.integer(key, MAX_EXPERTS)
        if experts == 0:
            return None
        dense = read.cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense
        ):
            raise read.error("mlp_only_layers", dense, "must be a list of layer indices")
        renormalize = (
            True
            if self.renormalize_key is None
            else read.flag(self.renormalize_key, self.renormalize_default)
        )
        intermediate = read.integer(self.intermediate_key, MAX_DIMENSION)
        top_k = read.integer("num_experts_per_tok", experts)
        shared_key = self.shared_expert_key
        shared = read.integer(shared_key, MAX_DIMENSION, lo=0, default=0) if shared_key else 0
        routing = Routing()
        if self.deepseek_topk_method is not None:
            dense = list(range(read.integer("first_k_dense_replace", MAX_LAYERS, lo=0, default=0)))
            if read.integer("moe_layer_freq", MAX_LAYERS, default=1) != 1:
                raise read.error(
                    "moe_layer_freq", read.cfg["moe_layer_freq"],
                    "Kiln runs DeepSeek models with an MoE block in every layer from first_k_dense_replace "
                    "on (moe_layer_freq 1, as transformers does)",
                )  # fmt: skip
            shared = intermediate * read.integer("n_shared_experts", MAX_EXPERTS, lo=0, default=0)
            routing = deepseek_routing(read, experts, top_k, self.deepseek_topk_method)
        return MoEConfig(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=intermediate,
            renormalize=renormalize,
            sparse_step=read.integer("decoder_sparse_step", MAX_LAYERS, default=1),
            dense_layers=frozenset(i for i in dense if 0 <= i < num_layers),
            shared_expert_intermediate=shared,
            routing=routing,
            activation=self.activation,
            swiglu_limit=(
                read.real("swiglu_limit", SWIGLU_OAI_DEFAULT_LIMIT, hi=MAX_SWIGLU_LIMIT)
                if self.activation == SWIGLU_OAI
                else 0.0
            ),
        )

    def router(self, cfg: ModelConfig, layer: int) -> LinearLayout:
        assert cfg.moe is not None
        name = f"model.layers.{layer}.{self.block}.{self.router_name}"
        shard = (ShardLayout(name, cfg.moe.num_experts),)
        return LinearLayout(
            name, shard, cfg.hidden_size, False, CLASS_REPLICATED, layer, replicated=True, full_precision=True
        )

    def shared_expert(self, layer: int) -> str:
        """The shared expert's module (a gated one's gate is this name + "_gate")."""
        return f"model.layers.{layer}.{self.block}.{self.shared_expert_name}"

    def shared_expert_linears(self, cfg: ModelConfig, layer: int) -> list[LinearLayout]:
        """The shared expert's SwiGLU MLP, after its gate (1, H) when it has one (replicated like the
        router)."""
        assert cfg.moe is not None
        if not cfg.moe.shared_expert_intermediate:
            return []
        mlp = self.shared_expert(layer)
        linears = mlp_linears(cfg, layer, mlp, cfg.moe.shared_expert_intermediate)
        if not self.shared_expert_gated:
            return linears
        name = f"{mlp}_gate"
        gate = LinearLayout(
            name, (ShardLayout(name, 1),), cfg.hidden_size, False, CLASS_REPLICATED, layer,
            replicated=True, full_precision=True,
        )  # fmt: skip
        return [gate, *linears]

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


def deepseek_routing(read: ConfigValues, experts: int, top_k: int, default_method: str) -> Routing:
    """DeepSeek's `scoring_func`, `topk_method` (noaux_tc: V3's corrected group-limited choice;
    group_limited_greedy: V2's; greedy: plain top-k), `n_group` / `topk_group` and
    `routed_scaling_factor`."""
    method = read.text("topk_method") or default_method
    scoring = read.text("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise read.error("scoring_func", scoring, "must be softmax or sigmoid")
    if method not in ("noaux_tc", "group_limited_greedy", "greedy"):
        raise read.error("topk_method", method, "must be noaux_tc, group_limited_greedy or greedy")
    scaling = read.real("routed_scaling_factor", 1.0, hi=MAX_ROUTED_SCALING)
    if method == "greedy":
        return Routing(scoring=scoring, scaling=scaling)
    groups = read.integer("n_group", experts, default=1)
    if experts % groups:
        raise read.error("n_group", groups, f"must divide the {experts} routed experts")
    topk_groups = read.integer("topk_group", groups, default=1)
    noaux = method == "noaux_tc"
    if noaux and experts // groups < 2 <= groups:
        raise read.error("n_group", groups, "leaves fewer than 2 experts per group (scored by its best two)")
    if topk_groups * (experts // groups) < top_k:
        raise read.error("topk_group", topk_groups, f"keeps fewer than num_experts_per_tok = {top_k} experts")
    return Routing(
        scoring=scoring,
        groups=groups,
        topk_groups=topk_groups,
        group_score="top2" if noaux else "max",
        correction_bias=noaux,
        scaling=scaling,
    )


def mla_attention_linears(cfg: ModelConfig, layer: int) -> list[LinearLayout]:
    """Multi-head latent attention, in vLLM's names: q_a_proj and kv_a_proj_with_mqa fused as
    `fused_qkv_a_proj` (both read the hidden state; replicated on every rank, as vLLM does), then
    q_b_proj (or a plain q_proj when q_lora_rank is null, column-parallel by heads with
    kv_a_proj_with_mqa replicated beside it), kv_b_proj (column-parallel by heads: each head's
    qk_nope rows then its v rows) and o_proj (row-parallel)."""
    mla = cfg.mla
    assert mla is not None
    h, heads = cfg.hidden_size, cfg.num_heads
    attn = f"model.layers.{layer}.self_attn"

    def replicated(name: str, shards: tuple[ShardLayout, ...], k: int) -> LinearLayout:
        return LinearLayout(name, shards, k, False, CLASS_REPLICATED, layer, replicated=True)

    def by_heads(name: str, per_head: int, k: int) -> LinearLayout:
        return LinearLayout(name, (ShardLayout(name, heads * per_head, heads),), k, False, CLASS_QKV, layer)

    kv_a = ShardLayout(f"{attn}.kv_a_proj_with_mqa", mla.latent_dim)
    if mla.q_lora_rank is None:
        q = [by_heads(f"{attn}.q_proj", mla.qk_head_dim, h), replicated(kv_a.module, (kv_a,), h)]
    else:
        q_a = ShardLayout(f"{attn}.q_a_proj", mla.q_lora_rank)
        q = [
            replicated(f"{attn}.fused_qkv_a_proj", (q_a, kv_a), h),
            by_heads(f"{attn}.q_b_proj", mla.qk_head_dim, mla.q_lora_rank),
        ]
    o = ShardLayout(f"{attn}.o_proj", h)
    return [
        *q,
        by_heads(f"{attn}.kv_b_proj", mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank),
        LinearLayout(o.module, (o,), heads * mla.v_head_dim, True, CLASS_ROW, layer),
    ]


@dataclass(frozen=True)
class Architecture:
    """What differs between the supported architectures: a new one is an entry in ARCHITECTURES."""

    name: str
    qkv_bias: bool = False  # q/k/v projections always carry a bias
    sliding_window: bool = False  # the config's sliding_window always applies
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    experts: ExpertNaming | None = None  # mixture-of-experts layers
    mla: bool = False  # multi-head latent attention (DeepSeek)
    mla_interleaved: bool = True  # MLA's rope pairs are interleaved unless `rope_interleave` says not
    layer_types: bool = False  # the window applies to the layers `layer_types` names (gpt-oss)
    attention_sinks: bool = False

    def attention_linears(self, cfg: ModelConfig, layer: int) -> list[LinearLayout]:
        return mla_attention_linears(cfg, layer) if self.mla else attention_linears(cfg, layer)

    def decoder_linears(self, cfg: ModelConfig, layer: int) -> list[LinearLayout]:
        """The linear layers of one decoder layer, in execution order (an MoE layer: its router)."""
        if self.experts is not None and cfg.is_moe_layer(layer):
            return [
                *self.attention_linears(cfg, layer),
                self.experts.router(cfg, layer),
                *self.experts.shared_expert_linears(cfg, layer),
            ]
        return [*self.attention_linears(cfg, layer), *mlp_linears(cfg, layer)]

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
QWEN2_MOE = dataclasses.replace(QWEN_MOE, shared_expert_key="shared_expert_intermediate_size")
MIXTRAL_MOE = ExpertNaming(
    block="block_sparse_moe",
    parts=(("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")),
    num_experts_keys=("num_local_experts",),
    intermediate_key="intermediate_size",
    renormalize_key=None,
)
DEEPSEEK_V3_MOE = ExpertNaming(
    block="mlp",
    parts=(("gate_proj", "up_proj", "down_proj"),),
    num_experts_keys=("n_routed_experts",),
    intermediate_key="moe_intermediate_size",
    renormalize_key="norm_topk_prob",
    shared_expert_name="shared_experts",
    shared_expert_gated=False,
    deepseek_topk_method="noaux_tc",
)
DEEPSEEK_V2_MOE = dataclasses.replace(DEEPSEEK_V3_MOE, deepseek_topk_method="greedy")
# gpt-oss: the router (a biased linear) picks the top k logits and softmaxes over them (= softmax, top
# k, renormalised); checkpoints stack the experts (services/convert/stacked_experts.py)
GPT_OSS_MOE = ExpertNaming(
    block="mlp",
    parts=(("gate_proj", "up_proj", "down_proj"),),
    num_experts_keys=("num_local_experts",),
    intermediate_key="intermediate_size",
    renormalize_key=None,
    router_name="router",
    activation=SWIGLU_OAI,
)
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM"),
        Architecture("MistralForCausalLM", sliding_window=True),
        Architecture("Qwen2ForCausalLM", qkv_bias=True),
        Architecture("Qwen3ForCausalLM", qk_norm=True),
        Architecture("Qwen2MoeForCausalLM", qkv_bias=True, experts=QWEN2_MOE),
        Architecture("Qwen3MoeForCausalLM", qk_norm=True, experts=QWEN_MOE),
        Architecture("MixtralForCausalLM", sliding_window=True, experts=MIXTRAL_MOE),
        Architecture("DeepseekV2ForCausalLM", experts=DEEPSEEK_V2_MOE, mla=True),
        Architecture("DeepseekV3ForCausalLM", experts=DEEPSEEK_V3_MOE, mla=True),
        Architecture("GptOssForCausalLM", experts=GPT_OSS_MOE, layer_types=True, attention_sinks=True),
    )
}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)


EMBEDDING_MODULE = "model.embed_tokens"


def linear_layouts(cfg: ModelConfig, has_lm_head: bool, tied_head: bool = False) -> list[LinearLayout]:
    """Every linear layer in execution order: each decoder layer's, then lm_head — the checkpoint's,
    or with `tied_head` a layer of its own read from the tied embedding (--quantize-head)."""
    arch = ARCHITECTURES[cfg.architecture]
    out = [lin for layer in range(cfg.num_layers) for lin in arch.decoder_linears(cfg, layer)]
    if has_lm_head or tied_head:
        lm_head = ShardLayout("lm_head" if has_lm_head else EMBEDDING_MODULE, cfg.vocab_size)
        head = LinearLayout("lm_head", (lm_head,), cfg.hidden_size, False, CLASS_LM_HEAD, None)
        out.append(dataclasses.replace(head, replicated=True, full_precision=True))
    return out


def expert_groups(cfg: ModelConfig) -> list[ExpertGroupLayout]:
    """Every MoE layer's expert group, in layer order."""
    arch = ARCHITECTURES[cfg.architecture]
    groups = (arch.expert_group(cfg, layer) for layer in range(cfg.num_layers))
    return [g for g in groups if g is not None]


@dataclass(frozen=True)
class KvCacheGeometry:
    """What one rank's KV cache holds per token and layer: `heads` entries of `width` keys (and as
    many values, unless `values` is False: MLA caches its latent and rope key as one key entry)."""

    heads: int
    width: int
    values: bool = True

    def bytes_per_token(self, num_layers: int, itemsize: int) -> int:
        return num_layers * self.heads * self.width * (2 if self.values else 1) * itemsize


def kv_cache_geometry(cfg: ModelConfig, world_size: int = 1) -> KvCacheGeometry:
    """KV heads are split over the ranks (each KV head whole on a rank; replicated when fewer than
    ranks); MLA's latent is replicated: every rank caches all of it."""
    if cfg.mla is not None:
        return KvCacheGeometry(1, cfg.mla.latent_dim, values=False)
    return KvCacheGeometry(max(1, cfg.num_kv_heads // world_size), cfg.head_dim)


@dataclass(frozen=True)
class RowRange:
    start: int
    size: int


def shard_rows(shard: ShardLayout, layout: LinearLayout, cfg: ModelConfig, rank: int, tp: int) -> RowRange:
    """Output rows of one shard of a column-parallel (or replicated) layer that rank `rank` holds."""
    if tp == 1 or layout.replicated or layout.row_parallel:
        return RowRange(0, shard.size)
    if shard.heads:
        head = shard.size // shard.heads
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
