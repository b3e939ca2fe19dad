"""Bind an opened artifact's tensors to the parameters of vLLM's model built with `KilnQuantConfig`.

On CPU every parameter becomes a view of the artifact's mapping; on GPU each is copied to the
device once. The only work besides that is each kernel's `bind_apply` (resolving tensors and
options for its hot path); an int4 CPU artifact packed by a torch build with another int4 layout is
repacked there, and the load report lists it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from runtime.loader import CheckedExpertGroup, CheckedLinear, check_dense_tensor
from runtime.vllm_plugin.artifact import PluginError, VllmArtifact
from runtime.vllm_plugin.quant_config import (
    BOUND_EXPERTS,
    KilnEmbeddingMethod,
    KilnLinearMethod,
    KilnMoEMethod,
    KilnQuantConfig,
    expert_param_name,
)


@dataclass
class Binding:
    """What the binding did: every parameter bound, and those that are not plain artifact tensors."""

    parameters: int = 0
    copied: list[str] = field(default_factory=list)  # padded embeddings, dtype casts, repacks
    runs_on: Counter[str] = field(default_factory=Counter)  # "vllm:<kernel>" | "kiln:<kernel>" -> layers
    # id(placeholder) -> (placeholder, bound): the placeholder is kept so that its id stays unique
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _Binder:
    def __init__(self, artifact: VllmArtifact) -> None:
        self.artifact = artifact
        self.binding = Binding()
        self.used: set[str] = set()
        self.bound_groups: set[str] = set()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.artifact.device == "cpu" else t.to(self.artifact.device)

    def set(self, module: nn.Module, attr: str, t: torch.Tensor) -> None:
        old = module._parameters.get(attr)
        new = _param(t)
        module._parameters[attr] = new
        if old is not None:
            self.binding.replaced[id(old)] = (old, new)
        self.binding.parameters += 1

    def linear(self, module: nn.Module, layer: CheckedLinear) -> None:
        spec, kernel = layer.spec, layer.kernel
        tensors = {suffix: self.to_device(t) for suffix, t in layer.tensors.items()}
        if ("bias" in tensors) != (getattr(module, "bias", None) is not None):
            raise PluginError(
                f"layer {spec.name}: the artifact {'has' if 'bias' in tensors else 'has no'} bias, vLLM's "
                f"model {'has none' if 'bias' in tensors else 'has one'} (another model config?)"
            )
        run_on = dict(tensors)
        if spec.row_parallel and self.artifact.rank != 0:
            run_on.pop("bias", None)  # the all-reduce adds a row-parallel bias once: rank 0 applies it
        before = {suffix: t.data_ptr() for suffix, t in run_on.items()}
        run = None
        if self.artifact.device != "cpu":
            from runtime.vllm_plugin.vllm_kernels import vllm_apply

            run = vllm_apply(kernel, run_on, spec)
        self.binding.runs_on[f"vllm:{kernel.name}" if run is not None else f"kiln:{kernel.name}"] += 1
        if run is None:
            run = kernel.bind_apply(run_on, spec)
        for suffix, t in tensors.items():
            bound = run_on.get(suffix, t)
            if bound.data_ptr() != before.get(suffix, bound.data_ptr()):
                self.binding.copied.append(f"{layer.name}.{suffix} (repacked by {kernel.name} for this CPU)")
            self.set(module, suffix, bound)
            self.used.add(f"{layer.name}.{suffix}")
        act = (
            torch.float32 if self.artifact.device == "cpu" and kernel.cpu_act_dtype == torch.float32 else None
        )

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = run(x if act is None or x.dtype == act else x.to(act))
            return y if y.dtype == x.dtype else y.to(x.dtype)

        module.kiln_forward = forward

    def experts(self, module: nn.Module, group: CheckedExpertGroup) -> None:
        tensors = {suffix: self.to_device(t) for suffix, t in group.tensors.items()}
        BOUND_EXPERTS[group.name] = group.kernel.bind_apply(tensors, group.spec)
        self.binding.runs_on[f"kiln:{group.kernel.name}"] += 1
        self.bound_groups.add(group.name)
        for suffix, t in tensors.items():
            self.set(module, expert_param_name(suffix), t)
            self.used.add(f"{group.name}.{suffix}")

    def embedding(self, module: nn.Module, prefix: str) -> None:
        name = f"{prefix}.weight"
        tensors = self.artifact.tensors
        if name not in tensors:
            if prefix == "lm_head" and self.artifact.config.tie_word_embeddings:
                return  # tied: takes the embedding's parameter below
            raise PluginError(f"tensor {name} is missing from rank {self.artifact.rank}'s files")
        cfg = self.artifact.config
        full = tensors[name]
        check_dense_tensor(name, full, (cfg.vocab_size, cfg.hidden_size))
        indices = module.shard_indices
        start, end = indices.org_vocab_start_index, indices.org_vocab_end_index
        rows = module.num_embeddings_per_partition
        if end - start == rows:
            t = self.to_device(full[start:end])  # a view of whole rows: no copy on CPU
        else:  # vLLM pads the vocabulary to a multiple of 64 rows per rank
            t = torch.zeros(rows, full.shape[1], dtype=full.dtype, device=self.artifact.device)
            t[: end - start] = full[start:end]
            self.binding.copied.append(f"{name} (padded from {end - start} to {rows} rows)")
        self.set(module, "weight", t)
        self.used.add(name)

    def remaining(self, model: nn.Module, done: set[int]) -> None:
        """Norms and the other parameters vLLM names as the artifact does (Hugging Face names)."""
        for qualified, param in list(model.named_parameters()):
            if id(param) in done or id(param) in self.binding.replaced:
                continue
            module_name, _, attr = qualified.rpartition(".")
            module = model.get_submodule(module_name)
            t = self.artifact.tensors.get(qualified)
            if t is None:
                raise PluginError(
                    f"vLLM's model has a parameter {qualified} {tuple(param.shape)} that rank "
                    f"{self.artifact.rank}'s files of {self.artifact.path} do not have"
                )
            check_dense_tensor(qualified, t, tuple(param.shape))
            t = self.to_device(t)
            if t.dtype != param.dtype:
                t = t.to(param.dtype)  # a norm stored in another dtype than vLLM runs (a few KB)
                self.binding.copied.append(f"{qualified} (cast to {str(param.dtype).removeprefix('torch.')})")
            self.set(module, attr, t)
            self.used.add(qualified)

    def retie(self, model: nn.Module) -> None:
        """Tied parameters (lm_head = embed_tokens) follow the parameter that replaced theirs, and so
        do references held by plain helper objects of a module (vLLM's MoE router keeps DeepSeek's
        `e_score_correction_bias` as an attribute of a non-Module router object)."""
        replaced = self.binding.replaced
        for module in model.modules():
            for attr, param in list(module._parameters.items()):
                if param is not None and id(param) in replaced:
                    module._parameters[attr] = replaced[id(param)][1]
            for holder in list(vars(module).values()):
                if isinstance(holder, nn.Module | torch.Tensor) or not hasattr(holder, "__dict__"):
                    continue
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and id(value) in replaced:
                        setattr(holder, name, replaced[id(value)][1])


def bind_model(model: nn.Module, artifact: VllmArtifact, config: KilnQuantConfig) -> Binding:
    binder = _Binder(artifact)
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if (
            isinstance(module, LinearBase)
            and not isinstance(method, KilnLinearMethod)
            and prefix in artifact.linears
        ):
            # A layer vLLM builds without the quantization config (Mixtral's router): the artifact
            # stores it for a Kiln kernel like any other, so it runs that kernel (vLLM's unquantized
            # method would repack the weight after loading).
            method = module.quant_method = KilnLinearMethod(config, artifact, prefix)
        if isinstance(method, KilnLinearMethod):
            binder.linear(module, method.layer)
        elif isinstance(method, KilnMoEMethod):
            binder.experts(module, method.group)
        elif isinstance(module, VocabParallelEmbedding):
            if not isinstance(method, KilnEmbeddingMethod):
                # Built without the quantization config (Mixtral's embed_tokens): vLLM's method would
                # hand back the stored dtype; Kiln's casts to the dtype vLLM created the layer in.
                module.quant_method = KilnEmbeddingMethod(config, artifact, prefix, module.weight.dtype)
            binder.embedding(module, prefix)
    binder.retie(model)
    done = {id(new) for _, new in binder.binding.replaced.values()}
    binder.remaining(model, done)
    binder.retie(model)
    binder.binding.replaced.clear()  # drop the placeholders
    missing = sorted(set(artifact.linears) - {name.rpartition(".")[0] for name in binder.used})
    missing += sorted(set(artifact.expert_groups) - binder.bound_groups)
    if missing:
        raise PluginError(
            f"the artifact's layer(s) / expert group(s) {missing[:3]} have no place in vLLM's model"
        )
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise PluginError(f"parameters left unbound: {left[:5]}")
    return binder.binding
