"""The `kiln` quantization config: vLLM's model gets Kiln's per-layer methods, whose parameters are
the artifact's tensors in their final layout. Nothing here transforms a tensor: creating a layer
registers placeholders with the artifact's shapes and dtypes, the loader binds the mapped tensors to
them, and `process_weights_after_loading` has nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import WeightsMapper

from runtime.artifact.hf_config import KILN_QUANT_METHOD, is_kiln_quant_config
from runtime.vllm_plugin.artifact import PluginError, VllmArtifact

LOAD_FORMAT_HINT = f"Kiln artifacts load with --load-format {KILN_QUANT_METHOD}"


def _refuse_weight_loader(name: str) -> Callable[..., None]:
    def weight_loader(*_args: Any, **_kwargs: Any) -> None:
        raise PluginError(f"{name}: {LOAD_FORMAT_HINT} (another loader tried to write into it)")

    return weight_loader


def _placeholder(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, where: str) -> None:
    """A meta parameter with the artifact tensor's shape and dtype (no memory): the loader binds it."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    param.weight_loader = _refuse_weight_loader(f"{where}.{name}")  # type: ignore[attr-defined]
    layer.register_parameter(name, param)


class KilnQuantConfig(QuantizationConfig):
    """Resolved from an artifact's config.json (`quant_method: kiln`), or `--quantization kiln`."""

    def __init__(self, hf_quant_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hf_quant_config = dict(hf_quant_config or {})
        self.artifact: VllmArtifact | None = None  # set by the kiln model loader before the model is built
        self.processed_layers = 0  # process_weights_after_loading calls (each a no-op)
        self.vllm_names: WeightsMapper | None = None  # the model's hf_to_vllm_mapper, when it has one

    def apply_vllm_mapper(self, hf_to_vllm_mapper: WeightsMapper) -> None:
        """vLLM hands over its model's HF -> vLLM renames before building it (gpt-oss: `.self_attn.`
        -> `.attn.`); the artifact's names are HF's."""
        self.vllm_names = hf_to_vllm_mapper
        if self.artifact is not None:
            self.bind_artifact(self.artifact)

    def bind_artifact(self, artifact: VllmArtifact) -> None:
        """The artifact the model is built from (set by the kiln model loader), keyed by vLLM's names."""
        mapper = self.vllm_names
        if mapper is not None:
            artifact.rename(lambda name: next(iter(mapper.apply_list([name])), name))
        self.artifact = artifact

    def get_name(self) -> str:  # type: ignore[override]
        return KILN_QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # Kiln's oldest GPU target; the loader checks the artifact's own target

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KilnQuantConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        if is_kiln_quant_config(hf_quant_cfg) or user_quant == KILN_QUANT_METHOD:
            return KILN_QUANT_METHOD
        return None

    def bound_artifact(self, prefix: str) -> VllmArtifact:
        if self.artifact is None:
            raise PluginError(f"layer {prefix}: {LOAD_FORMAT_HINT}")
        return self.artifact

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return KilnLinearMethod(self, self.bound_artifact(prefix), prefix)
        if isinstance(layer, VocabParallelEmbedding):
            return KilnEmbeddingMethod(self, self.bound_artifact(prefix), prefix)
        if isinstance(layer, RoutedExperts):
            return KilnMoEMethod(self, self.bound_artifact(prefix), prefix, layer.moe_config)
        return None


class KilnLinearMethod(LinearMethodBase):
    """One linear layer (fused q|k|v and gate|up as vLLM fuses them) run by its Kiln kernel."""

    def __init__(self, config: KilnQuantConfig, artifact: VllmArtifact, prefix: str) -> None:
        self.config = config
        self.layer = artifact.linear(prefix)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        spec = self.layer.spec
        shards = [s.size for s in spec.shards] or [spec.n]
        if list(output_partition_sizes) != shards or input_size_per_partition != spec.k:
            raise PluginError(
                f"layer {spec.name}: vLLM's model gives it outputs {list(output_partition_sizes)} and "
                f"{input_size_per_partition} inputs on this rank; the artifact has {shards} and {spec.k} "
                "(a different model config or TP size than the artifact was converted for)"
            )
        if getattr(layer, "skip_bias_add", False) and spec.has_bias:
            raise PluginError(f"layer {spec.name}: a bias added outside the layer is not supported")
        for suffix, t in self.layer.tensors.items():
            if suffix != "bias":  # vLLM's layer registers its own bias; the loader binds it
                _placeholder(layer, suffix, tuple(t.shape), t.dtype, spec.name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.config.processed_layers += 1  # the artifact is already in the kernel's layout

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # The kernel applies the layer's bias itself (not on row-parallel ranks > 0, as vLLM does).
        return layer.kiln_forward(x)


class KilnEmbeddingMethod(UnquantizedEmbeddingMethod):
    """Token embeddings and an unquantized lm_head: the artifact's tensor as stored, whatever its
    dtype; what it hands back to vLLM is in vLLM's dtype. A lookup is cast to the model dtype, the
    lm_head's logits to the dtype of the hidden states vLLM passes (its head dtype). An unquantized
    method to vLLM, so that a `head_dtype` override casts this weight as it casts its own."""

    def __init__(
        self,
        config: KilnQuantConfig,
        artifact: VllmArtifact,
        prefix: str,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.prefix = prefix
        self.dtype = artifact.embedding_dtype(prefix)
        self.model_dtype = model_dtype or self.dtype  # vLLM's: given, or set by create_weights

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        rows = sum(output_partition_sizes)
        self.model_dtype = params_dtype
        _placeholder(layer, "weight", (rows, input_size_per_partition), self.dtype, self.prefix)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.config.processed_layers += 1  # vLLM's would repack the weight for its CPU GEMM

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, layer.weight).to(self.model_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if x.dtype == weight.dtype:
            return F.linear(x, weight, bias)
        bias = None if bias is None else bias.to(weight.dtype)
        return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def expert_param_name(suffix: str) -> str:
    """The parameter name of a stacked expert tensor ("w13.qweight" -> "w13_qweight")."""
    return suffix.replace(".", "_")


class KilnMoEMethod(FusedMoEMethodBase):
    """One MoE layer's experts, stacked as the artifact stores them (`w13.*`, `w2.*`), run by the
    Kiln expert-group kernel on vLLM's routing (top-k ids and weights)."""

    def __init__(self, config: KilnQuantConfig, artifact: VllmArtifact, prefix: str, moe: Any) -> None:
        super().__init__(moe)
        self.config = config
        self.group = artifact.expert_group(prefix)

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        spec = self.group.spec
        if (num_experts, hidden_size, intermediate_size_per_partition) != (
            spec.num_experts,
            spec.hidden,
            spec.intermediate,
        ):
            raise PluginError(
                f"expert group {spec.name}: vLLM's model gives it {num_experts} local experts, hidden "
                f"{hidden_size}, intermediate {intermediate_size_per_partition} on this rank; the artifact "
                f"has {spec.num_experts}, {spec.hidden}, {spec.intermediate} (a different TP / EP layout "
                "than the artifact was converted for)"
            )
        for suffix, t in self.group.tensors.items():
            _placeholder(layer, expert_param_name(suffix), tuple(t.shape), t.dtype, spec.name)

    def get_fused_moe_quant_config(self, layer: nn.Module) -> None:
        return None  # the Kiln kernel runs the whole expert MLP; no vLLM modular kernel is built

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.config.processed_layers += 1

    def apply(  # type: ignore[override]
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A shared expert (Qwen2-MoE) is vLLM's own module over Kiln's linear layers: its runner runs
        # it and adds its output (this method declares no modular kernel to overlap it with).
        return torch.ops.kiln.experts(x, topk_ids, topk_weights, self.group.name)


# The bound expert groups of this process, by layer name, for the `kiln::experts` op.
BOUND_EXPERTS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {}


@torch.library.custom_op("kiln::experts", mutates_args=())
def experts_op(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: str
) -> torch.Tensor:
    """One expert group's MLP as an opaque op: Kiln's kernels group tokens by expert with
    data-dependent shapes, which vLLM's torch.compile cannot trace; as a custom op the compiled graph
    calls it like vLLM's own fused-MoE op."""
    return BOUND_EXPERTS[layer](x, topk_ids, topk_weights)


@experts_op.register_fake
def _experts_shape(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: str
) -> torch.Tensor:
    return torch.empty_like(x)
