"""The units of an artifact (its manifest's linear layers and expert groups), each checked for one rank
through one protocol before anything is bound: the unit has a place in the model config, its kernel
reads the manifest's layout version and takes the unit's spec on the artifact's target, the spec has
the shape the config gives it on this rank, and the rank's files hold exactly the tensors the kernel
declares. A new kind of unit is one `UnitCheck` plus one line in `UNIT_CHECKS` (and its manifest
section), as on the converter's side (services/convert/units).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from kernels.base import LinearKernel, LinearSpec, Target, check_stored
from kernels.errors import LayoutError
from kernels.moe_base import MoEKernel, MoESpec
from kernels.registry import get_kernel, get_moe_kernel
from runtime.artifact.manifest import ExpertGroupEntry, LayerEntry, Manifest
from runtime.artifact.model_values import HF_CONFIG
from runtime.load_errors import ARTIFACT_FIX, LoadError
from runtime.model_layout import (
    ExpertGroupLayout,
    LinearLayout,
    ModelConfig,
    expert_groups,
    expert_placement,
    linear_layouts,
    rank_shape,
)

K = TypeVar("K", LinearKernel, MoEKernel)
S = TypeVar("S", LinearSpec, MoESpec)


@dataclass(frozen=True)
class CheckedUnit(Generic[K, S]):
    """A unit of this rank: its kernel, this rank's spec and its tensors (views of the mapping),
    checked against the model config and the kernel's declared tensors."""

    name: str
    kernel: K
    spec: S
    tensors: dict[str, torch.Tensor]


CheckedLinear = CheckedUnit[LinearKernel, LinearSpec]
CheckedExpertGroup = CheckedUnit[MoEKernel, MoESpec]


@dataclass(frozen=True)
class RankView:
    """What a unit is checked against: the manifest, the model config, one rank's tensors."""

    manifest: Manifest
    cfg: ModelConfig
    tensors: dict[str, torch.Tensor]
    rank: int
    world_size: int

    @property
    def target(self) -> Target:
        return self.manifest.target


class UnitCheck(Protocol):
    section: str  # the manifest mapping of this kind's entries
    what: str  # how errors name a unit: "manifest layer", "expert group"

    def places(self, view: RankView) -> dict[str, Any]:
        """The model config's units of this kind by name (their layouts); a manifest entry without a
        place, or a place a complete kind needs without an entry, is refused here."""
        ...

    def kernel(self, name: str) -> Any: ...

    def rank_spec(self, name: str, entry: Any, layout: Any, view: RankView) -> Any:
        """This rank's spec of the unit (the manifest records rank 0's)."""
        ...

    def check_shape(self, name: str, spec: Any, layout: Any, view: RankView) -> None:
        """The spec against the shape the model config gives the unit on this rank (once its kernel
        is known to take the spec)."""
        ...

    def check_tensors(
        self, name: str, entry: Any, spec: Any, declared: dict, mine: dict, rank: int
    ) -> None: ...


def checked_units(check: UnitCheck, view: RankView) -> list[CheckedUnit]:
    """Every unit of the manifest section `check` reads, each checked for `view`'s rank."""
    places = check.places(view)
    out = []
    for name, entry in getattr(view.manifest, check.section).items():
        kernel = check.kernel(entry.kernel)
        spec = check.rank_spec(name, entry, places[name], view)
        check_kernel_fits(f"{check.what} {name}", kernel, entry.layout_version, spec, view.target)
        check.check_shape(name, spec, places[name], view)
        mine = {
            suffix: view.tensors[f"{name}.{suffix}"]
            for suffix in entry.tensors
            if f"{name}.{suffix}" in view.tensors
        }
        check.check_tensors(name, entry, spec, kernel.stored_tensors(spec, view.target), mine, view.rank)
        out.append(CheckedUnit(name, kernel, spec, mine))
    return out


class LinearCheck:
    section = "layers"
    what = "manifest layer"

    def places(self, view: RankView) -> dict[str, LinearLayout]:
        cfg, layers = view.cfg, view.manifest.layers
        layouts = {layout.name: layout for layout in linear_layouts(cfg, "lm_head" in layers)}
        for name in layers:
            if name not in layouts:
                raise LoadError(
                    f"manifest layer {name!r} has no place in {cfg.architecture} (is the converter newer?)"
                )
        return layouts

    def kernel(self, name: str) -> LinearKernel:
        return get_kernel(name)

    def rank_spec(self, name: str, entry: LayerEntry, layout: LinearLayout, view: RankView) -> LinearSpec:
        return entry.linear_spec()

    def check_shape(self, name: str, spec: LinearSpec, layout: LinearLayout, view: RankView) -> None:
        check_layer_shape(name, spec, layout, view)

    def check_tensors(
        self, name: str, entry: LayerEntry, spec: LinearSpec, declared: dict, mine: dict, rank: int
    ) -> None:
        """A layer's tensors in rank `rank`'s files against what its kernel declares for its spec."""
        listed = set(entry.tensors)
        absent = sorted(listed - set(mine))
        if absent:
            raise LoadError(
                f"tensor {name}.{absent[0]} (kernel {entry.kernel}) is missing from rank {rank}'s files"
            )
        undeclared = sorted(listed - set(declared))
        if undeclared:
            raise LoadError(
                f"manifest layer {name} lists tensor {undeclared[0]!r}, which kernel {entry.kernel} does "
                f"not store (it stores {sorted(declared)}); {ARTIFACT_FIX}"
            )
        try:
            check_stored(entry.kernel, spec, declared, mine)
        except LayoutError as e:
            raise LoadError(f"{e}; {ARTIFACT_FIX}") from e


class ExpertGroupCheck:
    section = "expert_groups"
    what = "expert group"

    def places(self, view: RankView) -> dict[str, ExpertGroupLayout]:
        layouts = {g.name: g for g in expert_groups(view.cfg)}
        absent = sorted(set(layouts) - set(view.manifest.expert_groups))
        extra = sorted(set(view.manifest.expert_groups) - set(layouts))
        if absent or extra:
            raise LoadError(
                f"expert groups: the model has {absent[:3] or 'none'} without a manifest entry and the "
                f"manifest has {extra[:3] or 'none'} without a place in {view.cfg.architecture}; "
                f"{ARTIFACT_FIX}"
            )
        return layouts

    def kernel(self, name: str) -> MoEKernel:
        return get_moe_kernel(name)

    def rank_spec(
        self, name: str, entry: ExpertGroupEntry, layout: ExpertGroupLayout, view: RankView
    ) -> MoESpec:
        return rank_moe_spec(
            entry.moe_spec(), layout, view.rank, view.world_size, view.manifest.expert_parallel
        )

    def check_shape(self, name: str, spec: MoESpec, layout: ExpertGroupLayout, view: RankView) -> None:
        """Nothing left: `rank_spec` placed this rank's experts and slice from the model config."""

    def check_tensors(
        self, name: str, entry: ExpertGroupEntry, spec: MoESpec, declared: dict, mine: dict, rank: int
    ) -> None:
        absent = sorted(set(declared) - set(mine))
        if absent or set(entry.tensors) - set(declared):
            raise LoadError(
                f"expert group {name} (kernel {entry.kernel}): tensors {entry.tensors} in the manifest, "
                f"{sorted(mine)} in rank {rank}'s files, the kernel stores {sorted(declared)}; {ARTIFACT_FIX}"
            )
        try:
            check_stored(entry.kernel, spec.w13, declared, mine)
        except LayoutError as e:
            raise LoadError(f"expert group {name}: {e}; {ARTIFACT_FIX}") from e


LINEAR_CHECK = LinearCheck()
EXPERT_GROUP_CHECK = ExpertGroupCheck()
UNIT_CHECKS: tuple[UnitCheck, ...] = (LINEAR_CHECK, EXPERT_GROUP_CHECK)


def checked_linear_layers(
    manifest: Manifest, cfg: ModelConfig, tensors: dict[str, torch.Tensor], rank: int, world_size: int
) -> list[CheckedLinear]:
    return checked_units(LINEAR_CHECK, RankView(manifest, cfg, tensors, rank, world_size))


def checked_expert_groups(
    manifest: Manifest, cfg: ModelConfig, tensors: dict[str, torch.Tensor], rank: int, world_size: int
) -> list[CheckedExpertGroup]:
    return checked_units(EXPERT_GROUP_CHECK, RankView(manifest, cfg, tensors, rank, world_size))


def check_kernel_fits(
    what: str, kernel: LinearKernel | MoEKernel, layout_version: int, spec: Any, target: Target
) -> None:
    """The kernel a manifest names lays its tensors out as the manifest's layout version says, and
    takes the unit's spec (bits, group size, scheme, strategy) on the artifact's target."""
    if layout_version != kernel.layout_version:
        raise LoadError(
            f"{what}: stored in {kernel.name} layout version {layout_version}, this Kiln's {kernel.name} "
            f"reads version {kernel.layout_version}; re-convert the checkpoint with this Kiln"
        )
    ok, reason = kernel.can_implement(spec, target)
    if not ok:
        raise LoadError(f"{what}: kernel {kernel.name} cannot run its spec: {reason}; {ARTIFACT_FIX}")


def config_dimensions(cfg: ModelConfig) -> str:
    """The model config's dimensions, as its fields are named (for errors about shapes)."""
    dims = (
        f"hidden_size = {cfg.hidden_size}, intermediate_size = {cfg.intermediate_size}, "
        f"num_attention_heads = {cfg.num_heads}, num_key_value_heads = {cfg.num_kv_heads}, "
        f"head_dim = {cfg.head_dim}, vocab_size = {cfg.vocab_size}"
    )
    if cfg.moe is not None:
        dims += f", experts = {cfg.moe.num_experts} of intermediate size {cfg.moe.intermediate_size}"
    return dims


def check_layer_shape(name: str, spec: LinearSpec, layout: LinearLayout, view: RankView) -> None:
    """The manifest's spec of a layer against the shape the model config gives it on this rank."""
    cfg, rank, world_size = view.cfg, view.rank, view.world_size
    want = rank_shape(layout, cfg, rank, world_size)
    got_shards = tuple(s.size for s in spec.shards) or (spec.n,)
    problems = []
    if spec.name != name:
        problems.append(f"spec names layer {spec.name!r}")
    if (spec.n, spec.k, spec.k_full) != (want.n, want.k, layout.k):
        problems.append(
            f"spec has N={spec.n}, K={spec.k} (whole K {spec.k_full}); the model config gives "
            f"N={want.n}, K={want.k} (whole K {layout.k}) on rank {rank} of {world_size} "
            f"({HF_CONFIG}: {config_dimensions(cfg)})"
        )
    elif got_shards != want.shard_sizes:
        problems.append(f"shard sizes {list(got_shards)}, the model config gives {list(want.shard_sizes)}")
    if spec.row_parallel != (layout.row_parallel and world_size > 1):
        problems.append(f"row_parallel={spec.row_parallel} does not fit this layer at tp={world_size}")
    if problems:
        raise LoadError(f"manifest layer {name}: {'; '.join(problems)}; {ARTIFACT_FIX}")


def rank_moe_spec(
    spec: MoESpec, layout: ExpertGroupLayout, rank: int, world_size: int, expert_parallel: bool
) -> MoESpec:
    """This rank's spec of an expert group (the manifest records rank 0's), checked against the
    placement the model config gives it."""
    place = expert_placement(layout, rank, world_size, expert_parallel)
    want = (layout.num_experts, place.num_experts, layout.top_k, layout.hidden, place.intermediate)
    got = (spec.total_experts, spec.num_experts, spec.top_k, spec.model_hidden, spec.model_intermediate)
    stored = (spec.w13.n, spec.w2.n) == (2 * spec.intermediate, spec.hidden)
    if got != want or not stored:
        raise LoadError(
            f"expert group {layout.name}: the manifest has {got[0]} experts ({got[1]} on this rank), "
            f"top-{got[2]}, hidden {got[3]}, intermediate {got[4]} per rank; the model config gives "
            f"{want[0]} ({want[1]}), top-{want[2]}, {want[3]}, {want[4]} on rank {rank} of {world_size}; "
            f"{ARTIFACT_FIX}"
        )
    return dataclasses.replace(spec, first_expert=place.first_expert)
