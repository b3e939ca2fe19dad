"""Caps on every size a checkpoint controls, checked before any work on it starts (one home).

A checkpoint is untrusted input to the conversion server: its JSON files are parsed in the API
process (POST /v1/plans) and its config.json decides how many layers and experts the planner and
the converter walk. A 1 KB config claiming `num_hidden_layers: 1e6` once kept /v1/plans busy for
41 s and grew the API from 0.4 to 3 GB. So, before a checkpoint is planned:

- every JSON file is size-checked before it is parsed (`JSON_MAX_BYTES`);
- every model dimension is within an absolute cap (`DIMENSION_CAPS`, runtime/model_layout.py: the
  runtime's own caps, far above any released model);
- the dimensions are checked against the tensors the safetensors headers actually hold: no more
  layers, hidden width or vocabulary rows than present, and MLP sizes (dense and per expert) whose
  weights would fit in the bytes present even at 2 bits per weight (`check_dimensions`); an expert
  the config claims but the tensors lack is refused by planning as it reaches it, before any work;
- a quantization config holds at most `MAX_CONFIG_ENTRIES` names per list and `MAX_CONFIG_PATTERNS`
  regular expressions of at most `MAX_PATTERN_CHARS` characters (services/convert/patterns.py),
  and its patterns times the model's modules stay within `MAX_PATTERN_MATCHES` (`check_pattern_work`,
  at the start of planning).

A checkpoint over a cap is refused with `CheckpointLimitError` (a 422 over REST) naming the field,
its value and the cap or the evidence.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.model_layout import ARCHITECTURES, DIMENSION_CAPS, ExpertNaming
from services.convert.errors import ConversionError

CONFIG_JSON_MAX_BYTES = 1 << 20
INDEX_JSON_MAX_BYTES = 64 << 20  # model.safetensors.index.json: ~100 bytes per tensor
# JSON files read from a checkpoint, by name; any other JSON file: CONFIG_JSON_MAX_BYTES.
JSON_MAX_BYTES: Mapping[str, int] = {"model.safetensors.index.json": INDEX_JSON_MAX_BYTES}

MAX_CONFIG_PATTERNS = 256  # regular expressions in one quantization config, all fields together
MAX_PATTERN_CHARS = 1024
PATTERN_MAX_MEM = 8 << 20  # RE2's memory budget per compiled pattern (its default)
MAX_CONFIG_ENTRIES = 4096  # names in one list field of a quantization config (ignore, targets, ...)
# Patterns x modules planned (each module's name may be tried against every pattern, ~3 us each).
MAX_PATTERN_MATCHES = 2_000_000

MIN_BITS_PER_WEIGHT = 2  # the narrowest format Kiln reads (GPTQ 2-bit)
LAYER_PREFIX = "model.layers."


class CheckpointLimitError(ConversionError):
    """A checkpoint file or dimension exceeds a documented cap, or a dimension claims more than the
    checkpoint's tensors hold."""


class _Tensor(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


def check_json_size(uri: str, name: str, size: int) -> None:
    """Refuse a JSON file over its cap before it is read or parsed."""
    cap = JSON_MAX_BYTES.get(name, CONFIG_JSON_MAX_BYTES)
    if size > cap:
        raise CheckpointLimitError(
            f"{uri}/{name} is {size} bytes, over Kiln's {cap}-byte limit for this file "
            "(services/convert/limits.py); a real checkpoint's file is far smaller: fix or trim it"
        )


def check_pattern_work(fmt: str, patterns: int, modules: int) -> None:
    """Refuse a config whose patterns would be tried against too many module names."""
    if patterns * modules > MAX_PATTERN_MATCHES:
        raise CheckpointLimitError(
            f"the {fmt} quantization config's {patterns} regular expressions against the model's "
            f"{modules} modules would take up to {patterns * modules} matches, over Kiln's cap of "
            f"{MAX_PATTERN_MATCHES} (services/convert/limits.py); merge the patterns into fewer"
        )


def _dimension(config: Mapping[str, Any], key: str) -> int | None:
    """A numeric dimension as an int (None when absent or not a number: ModelConfig reports those)."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointLimitError(f"config.json {key} = {value}; it must be a positive integer")
    return int(value)


def _refuse(key: str, value: int, evidence: str) -> CheckpointLimitError:
    return CheckpointLimitError(f"config.json {key} = {value}, but {evidence}; fix {key} in config.json")


def check_dimensions(config: Mapping[str, Any], tensors: Mapping[str, _Tensor]) -> None:
    """Every model dimension in `config` within its cap and within what `tensors` hold."""
    dims = {key: v for key in DIMENSION_CAPS if (v := _dimension(config, key)) is not None}
    held = _Held.scan(tensors)
    _check_layers(dims, held.layers)
    hidden = _check_hidden_and_vocab(dims, tensors)
    for key, value in dims.items():
        if value > DIMENSION_CAPS[key]:
            raise _refuse(key, value, f"Kiln caps it at {DIMENSION_CAPS[key]} (runtime/model_layout.py)")
    naming = _expert_naming(config)
    _check_mlp_bytes(dims, hidden, held, naming.intermediate_key if naming is not None else None)


@dataclass
class _Held:
    """What the tensors under model.layers.* show: layer numbers, MLP bytes per layer."""

    layers: set[int] = field(default_factory=set)
    dense_mlp_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    expert_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    @classmethod
    def scan(cls, tensors: Mapping[str, _Tensor]) -> _Held:
        held = cls()
        for name, info in tensors.items():
            index, _, rest = name.removeprefix(LAYER_PREFIX).partition(".")
            if not name.startswith(LAYER_PREFIX) or not (
                index.isascii() and index.isdigit() and len(index) < 10
            ):
                continue
            layer = int(index)
            held.layers.add(layer)
            if ".experts." in f".{rest}":
                held.expert_bytes[layer] += info.nbytes
            elif rest.startswith("mlp."):
                held.dense_mlp_bytes[layer] += info.nbytes
        return held

    def largest_dense_mlp(self) -> int | None:
        """Bytes of the largest MLP among layers without experts (an MoE layer's router and shared
        expert sit under `mlp.` too)."""
        dense = [b for layer, b in self.dense_mlp_bytes.items() if layer not in self.expert_bytes]
        return max(dense, default=None)


def _expert_naming(config: Mapping[str, Any]) -> ExpertNaming | None:
    archs = config.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    family = ARCHITECTURES.get(name) if name is not None else None
    return family.experts if family is not None else None


def _check_layers(dims: Mapping[str, int], layers: set[int]) -> None:
    claimed = dims.get("num_hidden_layers")
    if claimed is not None and claimed > len(layers):
        held = f"model.layers.{min(layers)}..{max(layers)}" if layers else "no model.layers.* tensors"
        raise _refuse(
            "num_hidden_layers",
            claimed,
            f"the checkpoint's safetensors headers hold tensors for {len(layers)} layers ({held})",
        )


def _rows(tensors: Mapping[str, _Tensor], name: str, axis: int) -> int | None:
    info = tensors.get(name)
    return info.shape[axis] if info is not None and len(info.shape) > axis else None


def _check_hidden_and_vocab(dims: Mapping[str, int], tensors: Mapping[str, _Tensor]) -> int | None:
    """The hidden size the tensors show (final norm, else embedding width), after checking the claims."""
    norm = tensors.get("model.norm.weight")
    held_hidden = norm.shape[0] if norm is not None and len(norm.shape) == 1 else None
    if held_hidden is None:
        held_hidden = _rows(tensors, "model.embed_tokens.weight", 1)
    claimed = dims.get("hidden_size")
    if claimed is not None and held_hidden is not None and claimed > held_hidden:
        raise _refuse("hidden_size", claimed, f"the checkpoint's hidden states are {held_hidden} wide")
    rows = [r for n in ("model.embed_tokens.weight", "lm_head.weight") if (r := _rows(tensors, n, 0))]
    vocab = dims.get("vocab_size")
    if vocab is not None and rows and vocab > max(rows):
        raise _refuse("vocab_size", vocab, f"the embedding and lm_head hold {max(rows)} rows")
    return held_hidden if held_hidden is not None else claimed


def _check_mlp_bytes(
    dims: Mapping[str, int], hidden: int | None, held: _Held, expert_key: str | None
) -> None:
    """An MLP of hidden size H and intermediate size I stores 3·H·I weights; at 2 bits each that is
    the least a layer's MLP tensors can weigh (an expert layer: E such MLPs)."""
    if hidden is None:
        return
    experts = max((dims.get(k, 0) for k in ("num_experts", "num_local_experts")), default=0)
    checks = [("intermediate_size", 1, held.largest_dense_mlp(), "")]
    if expert_key is not None:
        largest = max(held.expert_bytes.values(), default=None)
        checks.append((expert_key, max(experts, 1), largest, f" (per expert, {experts} experts)"))
    for key, count, largest, what in checks:
        claimed = dims.get(key)
        if claimed is None or largest is None:
            continue
        least = 3 * hidden * claimed * count * MIN_BITS_PER_WEIGHT // 8
        if least > largest:
            raise _refuse(
                key,
                claimed,
                f"MLPs that size{what} with hidden_size {hidden} need at least {least} bytes of weights "
                f"per layer even at {MIN_BITS_PER_WEIGHT} bits per weight, and the checkpoint's largest "
                f"layer holds {largest} bytes of them",
            )
