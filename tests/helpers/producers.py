"""The reference side of the source-format acceptance tests: a producer's own dequantized weights
in a transformers model run in fp32, the log-probs an artifact serves against it, and an artifact's
layers dequantized from what it stores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kernels.base import LinearSpec
from kernels.registry import get_kernel


def with_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`model` in fp32 with every module named in `weights` holding that (N, K) weight."""
    reference = model.float()
    modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            modules[name].weight.copy_(w)
    return reference


def served_log_prob_delta(uri: str, reference: torch.nn.Module, prompt: list[list[int]]) -> float:
    """Mean |log-prob difference| between the artifact at `uri` served by Kiln's runtime (one prefill)
    and `reference` on `prompt`."""
    from devtools.eval import runtime_logits_fn
    from runtime.loader import load_model

    ids = torch.tensor(prompt)
    with torch.inference_mode():
        got = runtime_logits_fn(load_model(uri))(ids)[0].float().log_softmax(-1)
        want = reference(ids).logits[0].float().log_softmax(-1)
    return (got - want).abs().mean().item()


def stored_layers(result: Any) -> Iterator[tuple[str, LinearSpec, torch.Tensor]]:
    """(layer, spec, its (N, K) fp32 weight as the kernel dequantizes what rank 0 stores) for every
    quantized layer of a conversion result."""
    stored = load_file(str(Path(result.uri.removeprefix("file://")) / "rank0.safetensors"))
    for layer, entry in result.manifest.layers.items():
        if entry.kernel == "dense":
            continue
        spec = entry.linear_spec()
        tensors = {k[len(layer) + 1 :]: v for k, v in stored.items() if k.startswith(layer + ".")}
        yield layer, spec, get_kernel(entry.kernel).dequantize(tensors, spec)


def producer_rows(producer: dict[str, torch.Tensor], spec: LinearSpec, layer: str) -> torch.Tensor:
    """The producer's weight of a (possibly fused) layer: its shards' weights stacked along N."""
    return torch.cat([producer[s.name] for s in spec.shards] if spec.shards else [producer[layer]])
