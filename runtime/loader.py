"""Open an artifact and bind its tensors into a model, with no load-time processing.

On CPU every tensor is a view into a private (copy-on-write) memory mapping of its safetensors
file: nothing is read until a kernel touches it, and nothing is copied. On CUDA each tensor is
copied once, host to device, straight from the mapping. The safetensors header is parsed here
(8-byte little-endian length + JSON) so the views' addresses are known to lie inside the mapping.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.base import LinearKernel, Target
from kernels.cpu_features import has_native_bf16
from kernels.errors import KilnError
from kernels.moe_base import MoEKernel
from kernels.registry import get_kernel, get_moe_kernel
from runtime.artifact.listed_files import ListedFileError, ListedFiles
from runtime.artifact.manifest import Manifest, artifact_file
from runtime.artifact.model_values import HF_CONFIG, checked_model_config
from runtime.artifact.safetensors_header import (
    DTYPES,
    SafetensorsFormatError,
    header_length,
    validate_header,
)
from runtime.kv_cache import KvCacheDtype
from runtime.layers import RMSNorm
from runtime.load_errors import ARTIFACT_FIX, LoadError
from runtime.model import LlamaForCausalLM, residual_dtype
from runtime.model_layout import ModelConfig
from runtime.settings import CpuActDtype, get_settings
from runtime.tokenizer import load_tokenizer
from runtime.unit_checks import (
    CheckedExpertGroup,
    CheckedLinear,
    checked_expert_groups,
    checked_linear_layers,
)

log = logging.getLogger(__name__)


class CorruptRankFileError(LoadError, SafetensorsFormatError):
    """A rank file's safetensors header is malformed (the artifact is corrupt or was tampered with)."""


class TargetMismatchError(KilnError):
    """The artifact was converted for a different machine than this one."""


@dataclass
class MappedFile:
    """A safetensors file mapped copy-on-write; `tensors` are views into `mapping`."""

    path: Path
    mapping: mmap.mmap
    base: torch.Tensor  # (file size,) uint8 over the whole mapping
    tensors: dict[str, torch.Tensor]

    @property
    def address_range(self) -> tuple[int, int]:
        start = self.base.data_ptr()
        return start, start + self.base.numel()


def map_safetensors(path: Path) -> MappedFile:
    """Memory-map a safetensors file and view every tensor in place (no copy, no read).

    The header is validated first (CorruptRankFileError): every view lies inside the mapping."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise CorruptRankFileError(f"{path.name}: too short to be a safetensors file; {ARTIFACT_FIX}")
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        header_len = header_length(path.name, mapping[:8], size, error=CorruptRankFileError)
        parsed = validate_header(path.name, mapping[: 8 + header_len], size, error=CorruptRankFileError)
    except BaseException:
        mapping.close()
        raise
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    data_start = parsed.data_start
    tensors: dict[str, torch.Tensor] = {}
    for name, info in parsed.tensors.items():
        dtype = DTYPES[info.dtype]
        raw = base[data_start + info.begin : data_start + info.end]
        if (data_start + info.begin) % dtype.itemsize:
            log.warning("%s: tensor %s is misaligned in the file; copying it", path.name, name)
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(info.shape)
    return MappedFile(path=path, mapping=mapping, base=base, tensors=tensors)


def check_target(target: Target, device: str) -> None:
    """Refuse an artifact whose target does not fit `device` on this machine."""
    if not target.is_gpu:
        if device != "cpu":
            raise TargetMismatchError(
                f"artifact built for cpu cannot run on {device}; "
                f"convert with --target sm{_capability() or 'XX'}"
            )
        return
    if not torch.cuda.is_available():
        raise TargetMismatchError(
            f"artifact built for {target.value}; this machine has no CUDA device — convert with --target cpu"
        )
    if device == "cpu":
        raise TargetMismatchError(f"artifact built for {target.value} must run on a CUDA device, not cpu")
    have = _capability()
    if have < target.capability:
        raise TargetMismatchError(
            f"artifact built for {target.value}; this GPU is sm{have} — convert with --target sm{have}"
        )


def _capability() -> int:
    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def compute_dtype(manifest: Manifest, device: str, cpu_act_dtype: CpuActDtype = "auto") -> torch.dtype:
    """Activation dtype (linear kernels, attention, KV cache); the residual stream stays fp32 on
    CPU (runtime/model.py). GPU: the artifact's act_dtype. CPU: bf16 when every layer's kernel
    prefers bf16 activations (`LinearKernel.cpu_act_dtype`), the artifact was not built for fp32
    activations and the CPU has native bf16 (`cpu_act_dtype` "auto") or bf16 is asked for
    ("bfloat16": emulated where the CPU has no native bf16); else fp32 (dense CPU layers store
    fp32 weights: fp32 GEMM, bf16 / fp16 -> fp32 exact). "float32" forces fp32."""
    if device != "cpu":
        return getattr(torch, manifest.act_dtype)
    kernels: list[LinearKernel | MoEKernel] = [get_kernel(e.kernel) for e in manifest.layers.values()]
    kernels += [get_moe_kernel(e.kernel) for e in manifest.expert_groups.values()]
    if (
        cpu_act_dtype != "float32"
        and manifest.act_dtype != "float32"
        and kernels
        and all(k.cpu_act_dtype == torch.bfloat16 for k in kernels)
        and (cpu_act_dtype == "bfloat16" or has_native_bf16())
    ):
        return torch.bfloat16
    return torch.float32


def default_device(manifest: Manifest) -> str:
    return "cuda" if manifest.target.is_gpu else "cpu"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    manifest: Manifest
    tokenizer: Any
    config: ModelConfig
    artifact_dir: Path = Path()
    device: str = "cpu"
    rank: int = 0
    world_size: int = 1
    kv_cache_dtype: KvCacheDtype = "auto"
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    files: list[MappedFile] = field(default_factory=list)  # keeps the mappings alive
    load_seconds: float = 0.0


GENERATION_CONFIG = "generation_config.json"


def token_ids(value: object, where: str) -> set[int]:
    """An `eos_token_id` value (absent, a token id or a list of them) as a set; ListedFileError
    naming `where` for anything else."""
    if value is None:
        return set()
    items = value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ListedFileError(
            f"{where}: eos_token_id = {str(value)[:80]}: must be a token id or a list of token ids; "
            "the artifact is corrupt or was altered — pull it again or re-convert it"
        )
    return set(items)


def eos_token_ids(files: ListedFiles, hf_config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation: the model config's, generation_config.json's (when the manifest
    lists it) and the tokenizer's eos token."""
    ids = token_ids(hf_config.get("eos_token_id"), HF_CONFIG)
    generation = files.json_object(GENERATION_CONFIG)
    if generation is not None:
        ids |= token_ids(generation.get("eos_token_id"), str(files.artifact_dir / GENERATION_CONFIG))
    if tokenizer is not None and isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def check_tp(manifest: Manifest, rank: int, world_size: int, *, flag: str | None = None) -> None:
    """The artifact's TP size against this run's (`flag`: how the user sets it for this host; None
    for Kiln's own commands, which run one rank)."""
    if manifest.tp != world_size:
        vllm = f"vllm serve ARTIFACT --load-format kiln --tensor-parallel-size {manifest.tp}"
        kiln = f"kiln serve ARTIFACT --tp {manifest.tp}"
        how = f"run with {flag} {manifest.tp}" if flag else f"serve it with `{kiln}` or `{vllm}`"
        raise LoadError(
            f"artifact was sharded for tp={manifest.tp}; this run has world_size={world_size} — "
            f"{how}, or convert with --tp {world_size}"
        )
    if not 0 <= rank < world_size:
        raise LoadError(f"rank {rank} out of range for world_size {world_size}")


def map_rank_files(artifact_dir: Path, manifest: Manifest, rank: int) -> list[MappedFile]:
    """Map rank `rank`'s files (and only those), after checking that the shared files (config,
    tokenizer, read later) do not lead out of the artifact and that each rank file has its size."""
    for entry in manifest.shared_files():
        artifact_file(artifact_dir, entry.name)
    files: list[MappedFile] = []
    for entry in manifest.rank_files(rank):
        path = artifact_file(artifact_dir, entry.name)
        if not path.is_file():
            raise LoadError(
                f"{path} is missing: pull the artifact for rank {rank} (kiln pull URI --rank {rank})"
            )
        if path.stat().st_size != entry.size:
            raise LoadError(
                f"{path} has {path.stat().st_size} bytes, the manifest says {entry.size}: "
                "truncated — pull it again"
            )
        files.append(map_safetensors(path))
    return files


def check_dimensions(cfg: ModelConfig, tensors: dict[str, torch.Tensor], rank: int) -> None:
    """The model config's vocabulary and hidden sizes against the shapes the rank files' headers
    give the embedding, the final norm and an untied lm_head (before anything is built from them)."""
    want = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
        "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
    }
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            if name != "lm_head.weight":
                raise LoadError(f"tensor {name} is missing from rank {rank}'s files; {ARTIFACT_FIX}")
        elif tuple(t.shape) != shape:
            raise LoadError(
                f"{HF_CONFIG}: vocab_size = {cfg.vocab_size}, hidden_size = {cfg.hidden_size} make {name} "
                f"{shape}, but rank {rank}'s files hold it as {tuple(t.shape)}; the manifest was altered "
                f"or does not belong to these files — {ARTIFACT_FIX}"
            )


def bind_expert_groups(
    model: LlamaForCausalLM,
    groups: dict[str, CheckedExpertGroup],
    used: set[str],
    to_device: Callable[[torch.Tensor], torch.Tensor],
    rank: int = 0,
) -> None:
    """Bind every MoE layer's expert group (checked by `checked_expert_groups`). Under TP (experts
    split along I) each rank's down projections give a partial sum: their bias (gpt-oss) is added on
    rank 0 only, as for any row-parallel layer."""
    modules = model.expert_groups()
    for group in groups.values():
        used.update(f"{group.name}.{suffix}" for suffix in group.tensors)
        bound = {suffix: to_device(t) for suffix, t in group.tensors.items()}
        if group.spec.w2.row_parallel and rank != 0:
            bound.pop("w2.bias", None)
        modules[group.name].bind(group.kernel, group.spec, bound)


def check_dense_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or not t.dtype.is_floating_point:
        raise LoadError(
            f"tensor {name} is {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}; the model config "
            f"needs a floating-point {shape}; {ARTIFACT_FIX}"
        )


def _set_param(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module._parameters[name] = nn.Parameter(tensor, requires_grad=False)


@dataclass
class OpenedArtifact:
    """An artifact opened for one rank on one device, before any weight is read: its manifest read
    once and every check made once (model config values, target, TP, dimensions, every layer and
    expert group against its kernel's declared tensors), this rank's files mapped. `kiln serve`,
    `kiln generate`, `load_model` and the vLLM plugin all start here."""

    path: Path
    manifest: Manifest
    config: ModelConfig
    device: str  # "cpu" or "cuda"
    rank: int
    world_size: int
    files: list[MappedFile] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's, views of the mapping
    linears: dict[str, CheckedLinear] = field(default_factory=dict)
    expert_groups: dict[str, CheckedExpertGroup] = field(default_factory=dict)

    def address_ranges(self) -> list[tuple[int, int]]:
        return [f.address_range for f in self.files]


def open_artifact(
    artifact_dir: Path | str,
    *,
    device: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    verify: bool = False,
    tp_flag: str | None = None,
) -> OpenedArtifact:
    """Check an artifact against this host and rank, then map its rank files (no reads). `verify`
    hashes the rank's files against the manifest first; `tp_flag` names the host's TP option in a
    TP-mismatch refusal. Every value of the manifest and its model config is checked before anything
    is mapped (the manifest's size is capped before it is parsed: MAX_MANIFEST_BYTES)."""
    path = Path(artifact_dir)
    if verify:
        from runtime.artifact.pull import verify_local

        manifest = verify_local(path, rank)
    else:
        manifest = Manifest.load(path)
    cfg = checked_model_config(manifest)
    device = device or default_device(manifest)
    check_target(manifest.target, device)
    check_tp(manifest, rank, world_size, flag=tp_flag)
    files = map_rank_files(path, manifest, rank)
    tensors = {name: t for mapped in files for name, t in mapped.tensors.items()}
    check_dimensions(cfg, tensors, rank)
    linears = {layer.name: layer for layer in checked_linear_layers(manifest, cfg, tensors, rank, world_size)}
    groups = {group.name: group for group in checked_expert_groups(manifest, cfg, tensors, rank, world_size)}
    return OpenedArtifact(path, manifest, cfg, device, rank, world_size, files, tensors, linears, groups)


def _bind_linears(
    model: LlamaForCausalLM,
    opened: OpenedArtifact,
    used: set[str],
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Every checked linear layer bound to its module; a module without a manifest entry refused."""
    linears = model.linear_layers()
    for layer in opened.linears.values():
        module = linears.get(layer.name)
        if module is None:
            raise LoadError(
                f"manifest layer {layer.name!r} has no place in {opened.config.architecture} "
                "(is the converter newer?)"
            )
        used.update(f"{layer.name}.{suffix}" for suffix in layer.tensors)
        bound = {suffix: to_device(t) for suffix, t in layer.tensors.items()}
        if layer.spec.row_parallel and opened.rank != 0:
            bound.pop("bias", None)  # the all-reduce must add a row-parallel bias once: rank 0 applies it
        module.bind(layer.kernel, layer.spec, bound)
    missing = [m.name for m in linears.values() if m.kernel is None]
    if missing:
        raise LoadError(
            f"the manifest has no entry for layer(s) {', '.join(missing[:5])}: artifact incomplete"
        )


def _bind_dense(
    model: LlamaForCausalLM,
    opened: OpenedArtifact,
    norm_dtype: torch.dtype,
    used: set[str],
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Embeddings, norms and router biases under their HF names (norm weights are tiny: cast to the
    residual dtype; the rest kept as stored), and the lm_head weight when it is not a linear layer of
    the manifest."""
    tensors, cfg = opened.tensors, opened.config
    per_head = model.per_head_parameter_names()
    for hf_name, (module, attr) in model.hf_parameter_names().items():
        if hf_name not in tensors:
            raise LoadError(f"tensor {hf_name} is missing from rank {opened.rank}'s files")
        t = tensors[hf_name]
        if hf_name in per_head and opened.world_size > 1 and t.shape[0] == cfg.num_heads:
            t = t.chunk(opened.world_size)[opened.rank]  # this rank's attention heads
        check_dense_tensor(hf_name, t, tuple(getattr(module, attr).shape))
        t = to_device(t)
        if isinstance(module, RMSNorm) and t.dtype != norm_dtype:
            t = t.to(norm_dtype)
        _set_param(module, attr, t)
        used.add(hf_name)
    if "lm_head" in opened.manifest.layers:
        return
    if "lm_head.weight" in tensors:
        check_dense_tensor("lm_head.weight", tensors["lm_head.weight"], (cfg.vocab_size, cfg.hidden_size))
        head = to_device(tensors["lm_head.weight"])
        used.add("lm_head.weight")
    elif cfg.tie_word_embeddings:
        head = model.embed_tokens.weight
    else:
        raise LoadError("no lm_head layer or lm_head.weight, and the config does not tie embeddings")
    # Used as stored (no load-time copy): the hidden state is cast to its dtype (runtime/model.py).
    model.lm_head_weight = head


def _bind_derived(
    model: LlamaForCausalLM,
    opened: OpenedArtifact,
    used: set[str],
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """The converter's derived tensors (MLA's absorbed matrices), each checked against its place."""
    places = model.derived_parameter_names()
    for entry_name, entry in opened.manifest.derived.items():
        for suffix in entry.tensors:
            name = f"{entry_name}.{suffix}"
            if name not in places:
                raise LoadError(
                    f"manifest derived tensor {name!r} has no place in {opened.config.architecture} "
                    "(is the converter newer?)"
                )
            if name not in opened.tensors:
                raise LoadError(f"tensor {name} is missing from rank {opened.rank}'s files; {ARTIFACT_FIX}")
            module, attr = places[name]
            check_dense_tensor(name, opened.tensors[name], tuple(getattr(module, attr).shape))
            _set_param(module, attr, to_device(opened.tensors[name]))
            used.add(name)
    missing = sorted(set(places) - used)
    if missing:
        raise LoadError(
            f"the manifest has no derived entry for {missing[0]} (MLA's absorbed matrices, made at "
            "conversion): the artifact was made by an older converter — re-convert the checkpoint"
        )


def load_model(
    artifact: Path | str | OpenedArtifact,
    *,
    device: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    kv_cache_dtype: KvCacheDtype = "auto",
    with_tokenizer: bool = True,
    cpu_act_dtype: CpuActDtype | None = None,
) -> LoadedModel:
    """Build the runtime's model on an artifact (a path is opened with `open_artifact`; `device`,
    `rank` and `world_size` apply then) and bind every tensor to it. `cpu_act_dtype`: see
    `compute_dtype` (None: the KILN_CPU_ACT_DTYPE setting)."""
    import time

    started = time.perf_counter()
    opened = (
        artifact
        if isinstance(artifact, OpenedArtifact)
        else open_artifact(artifact, device=device, rank=rank, world_size=world_size)
    )
    manifest, cfg, tensors, device = opened.manifest, opened.config, opened.tensors, opened.device
    rank, world_size, artifact_dir = opened.rank, opened.world_size, opened.path
    if cpu_act_dtype is None:
        cpu_act_dtype = get_settings().cpu_act_dtype
    dtype = compute_dtype(manifest, device, cpu_act_dtype)
    has_lm_head_layer = "lm_head" in manifest.layers
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, world_size=world_size, has_lm_head=has_lm_head_layer)

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t if device == "cpu" else t.to(device, non_blocking=False)

    used: set[str] = set()
    _bind_linears(model, opened, used, to_device)
    bind_expert_groups(model, opened.expert_groups, used, to_device, opened.rank)
    _bind_dense(model, opened, residual_dtype(dtype, device), used, to_device)
    _bind_derived(model, opened, used, to_device)
    unused = sorted(set(tensors) - used)
    if unused:
        log.warning("ignoring %d tensor(s) the model does not use, e.g. %s", len(unused), unused[:3])
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise LoadError(f"parameters left unbound: {leftover[:5]}")

    listed = ListedFiles(artifact_dir, manifest)
    tokenizer = load_tokenizer(artifact_dir, manifest) if with_tokenizer else None
    return LoadedModel(
        model=model,
        manifest=manifest,
        tokenizer=tokenizer,
        config=cfg,
        artifact_dir=artifact_dir,
        device=device,
        rank=rank,
        world_size=world_size,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
        eos_token_ids=eos_token_ids(listed, manifest.hf_config, tokenizer),
        files=opened.files,
        load_seconds=time.perf_counter() - started,
    )
