"""A Kiln artifact opened for one vLLM rank (`runtime.loader.open_artifact`, as `kiln serve` opens
one, plus what only vLLM refuses): every refusal a user can act on happens here, before any weight is
read (mapping a file reads nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.errors import KilnError
from runtime.artifact.manifest import Manifest
from runtime.loader import CheckedExpertGroup, CheckedLinear, OpenedArtifact
from runtime.loader import open_artifact as open_for_rank

# Every architecture of runtime/model_layout.py: vLLM's models name their modules and parameters as
# Kiln's manifest does (fused qkv_proj / gate_up_proj, Hugging Face names for norms and embeddings,
# expert groups at `…mlp.experts` / `…block_sparse_moe.experts`, the router as a linear `…gate`).
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PluginError(KilnError):
    """A Kiln artifact cannot be served by this vLLM as asked; the message says what to do."""


class VllmArtifact(OpenedArtifact):
    """An opened artifact with the lookups vLLM's model builder makes, refused in vLLM's terms."""

    def rename(self, vllm_name: Callable[[str], str]) -> None:
        """Key the layers, expert groups and tensors by the names vLLM's model gives them (its
        `hf_to_vllm_mapper`: gpt-oss's attention is `….attn.`, its token embedding `model.embedding`;
        the other architectures' vLLM names are the artifact's)."""
        self.linears = {
            vllm_name(n): dataclasses.replace(u, name=vllm_name(n)) for n, u in self.linears.items()
        }
        self.expert_groups = {
            vllm_name(n): dataclasses.replace(g, name=vllm_name(n)) for n, g in self.expert_groups.items()
        }
        self.tensors = {vllm_name(n): t for n, t in self.tensors.items()}

    def linear(self, prefix: str) -> CheckedLinear:
        layer = self.linears.get(prefix)
        if layer is None:
            raise PluginError(
                f"vLLM's {self.manifest.architecture} has a linear layer {prefix!r} that the artifact "
                f"does not have (the artifact's layers look like {next(iter(self.linears), 'none')!r})"
            )
        return layer

    def expert_group(self, prefix: str) -> CheckedExpertGroup:
        group = self.expert_groups.get(prefix)
        if group is None:
            raise PluginError(
                f"vLLM's {self.manifest.architecture} has a mixture-of-experts layer {prefix!r} that the "
                f"artifact does not have (its expert groups: {sorted(self.expert_groups)[:3] or 'none'})"
            )
        return group

    def embedding_dtype(self, prefix: str) -> torch.dtype:
        """The stored dtype of an embedding-shaped tensor: vLLM builds some embeddings without a
        prefix (Llama's embed_tokens) and ties lm_head to them, so all but a separately stored
        lm_head take the token embedding's."""
        name = f"{prefix}.weight" if f"{prefix}.weight" in self.tensors else EMBEDDING
        t = self.tensors.get(name)
        if t is None:
            raise PluginError(f"tensor {name} is missing from rank {self.rank}'s files of {self.path}")
        return t.dtype

    def check_model_dtype(self, dtype: torch.dtype) -> None:
        """Every layer's kernel takes activations of vLLM's model dtype (`--dtype`), checked before
        vLLM builds its model. Embeddings and an unquantized lm_head take any dtype (their outputs are
        cast to the model's / head's dtype); norms are cast to it when bound."""
        target = self.manifest.target
        layers: list[tuple[str, str, frozenset[torch.dtype]]] = [
            (name, layer.kernel.name, layer.kernel.act_dtypes(layer.spec, target))
            for name, layer in self.linears.items()
            if name != LM_HEAD
        ]
        layers += [
            (name, group.kernel.name, group.kernel.act_dtypes(group.spec, target))
            for name, group in self.expert_groups.items()
        ]
        for name, kernel, dtypes in layers:
            if dtype not in dtypes:
                names = sorted(dtype_name(d) for d in dtypes)
                takes, want = " / ".join(names), dtype_name(dtype)
                raise PluginError(
                    f"layer {name}: kernel {kernel} of this {target.value} artifact takes {takes} "
                    f"activations, not vLLM's model dtype {want}: run vLLM with --dtype {names[0]}"
                )


def refuse_unservable(manifest: Manifest) -> None:
    """What the plugin cannot map, named with what to do instead."""
    if LM_HEAD in manifest.layers and manifest.layers[LM_HEAD].kernel != "dense":
        raise PluginError(
            f"lm_head is stored for kernel {manifest.layers[LM_HEAD].kernel}; vLLM's lm_head takes only "
            "an unquantized weight: serve this artifact with `kiln serve`, or convert for vLLM with "
            "`--quantize-head none` (a cpu conversion of a 4-bit checkpoint quantizes the head by default)"
        )


def open_artifact(path: str | Path, *, device: str, rank: int, world_size: int, verify: bool) -> VllmArtifact:
    """Check the artifact against this host and rank, then map its rank files (no reads)."""
    opened = open_for_rank(
        path, device=device, rank=rank, world_size=world_size, verify=verify, tp_flag="--tensor-parallel-size"
    )
    refuse_unservable(opened.manifest)
    return VllmArtifact(**{f.name: getattr(opened, f.name) for f in dataclasses.fields(opened)})
