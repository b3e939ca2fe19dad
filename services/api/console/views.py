"""What the console's pages show, built from the API's own records: a plan grid (layers × targets,
kernel per cell, fallbacks and rejections) from plans or from artifact manifests, and the artifact
matrix (model × target, each artifact with its method, TP/EP, size, checksum and serve commands).
Pure functions of JSON-like data: the templates only lay them out."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernels.targets import Target

# Kernel colours: a fixed palette, a kernel's colour chosen by a stable hash of its name.
KERNEL_PALETTE_SIZE = 12
TARGET_ORDER = [t.value for t in Target]
LIVE_STATUSES = ("queued", "running")


def kernel_class(kernel: str) -> str:
    """The CSS class that colours `kernel` (the same in every grid and every page)."""
    digest = hashlib.sha256(kernel.encode()).digest()
    return f"k{digest[0] % KERNEL_PALETTE_SIZE}"


@dataclass(frozen=True)
class Rejection:
    kernel: str
    reason: str


@dataclass(frozen=True)
class Cell:
    kernel: str
    fallback: bool
    rejections: tuple[Rejection, ...]
    scheme: str = ""
    verification: str = ""  # "exact", "max_rel_err 1.2e-03 ≤ 4e-03", "FAILED …"; "" when not verified
    verified_ok: bool = True

    @property
    def css(self) -> str:
        return kernel_class(self.kernel) + (" fallback" if self.fallback else "")

    @property
    def hover(self) -> str:
        """The cell's title: the kernel, then every rejection with its reason."""
        lines = [self.kernel + (" (fallback)" if self.fallback else "")]
        lines += [f"{r.kernel}: {r.reason}" for r in self.rejections]
        return "\n".join(lines)


@dataclass(frozen=True)
class TargetSummary:
    target: str
    fallbacks: int
    layers: int
    notes: tuple[str, ...] = ()
    size_bytes: int | None = None
    artifact_id: str | None = None


@dataclass
class PlanGrid:
    """Rows are runtime layers in model order; columns are targets in the target list's order."""

    targets: list[str] = field(default_factory=list)
    rows: list[tuple[str, list[Cell | None]]] = field(default_factory=list)
    summaries: list[TargetSummary] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # the legend, in first-seen order

    @property
    def empty(self) -> bool:
        return not self.rows


def _ordered_targets(names: Iterable[str]) -> list[str]:
    names = set(names)
    return [t for t in TARGET_ORDER if t in names] + sorted(names - set(TARGET_ORDER))


def _grid(columns: Mapping[str, dict[str, Cell]], summaries: Mapping[str, TargetSummary]) -> PlanGrid:
    targets = _ordered_targets(columns)
    layers: dict[str, None] = {}
    for t in targets:
        layers.update(dict.fromkeys(columns[t]))
    grid = PlanGrid(targets=targets, summaries=[summaries[t] for t in targets])
    legend: dict[str, None] = {}
    for layer in layers:
        cells = [columns[t].get(layer) for t in targets]
        legend.update(dict.fromkeys(c.kernel for c in cells if c is not None))
        grid.rows.append((layer, cells))
    grid.kernels = list(legend)
    return grid


def grid_from_plans(plans: Iterable[Mapping[str, Any]]) -> PlanGrid:
    """A grid of plans as POST /v1/plans returns them (`Plan.to_json()`), one per target."""
    columns: dict[str, dict[str, Cell]] = {}
    summaries: dict[str, TargetSummary] = {}
    for plan in plans:
        target = str(plan["target"])
        columns[target] = {
            row["layer"]: Cell(
                kernel=row["kernel"],
                fallback=bool(row["fallback"]),
                rejections=tuple(Rejection(r["kernel"], r["reason"]) for r in row["rejections"]),
                scheme=row.get("scheme", ""),
            )
            for row in plan["layers"]
        }
        summaries[target] = TargetSummary(
            target=target,
            fallbacks=int(plan["fallbacks"]),
            layers=len(plan["layers"]),
            notes=tuple(plan.get("notes", ())),
            size_bytes=int(plan["expected_bytes"]["total"]),
        )
    return _grid(columns, summaries)


def _verification(entry: Mapping[str, Any]) -> tuple[str, bool]:
    v = entry.get("verification")
    if not v:
        return "", True
    if v["metric"] == "exact" and v["ok"]:
        return "exact", True
    text = f"{v['metric']} {v['value']:.2e} ≤ {v['bound']:.2e}"
    return (text if v["ok"] else f"FAILED {text}"), bool(v["ok"])


def _manifest_cell(entry: Mapping[str, Any]) -> Cell:
    text, ok = _verification(entry)
    return Cell(
        kernel=entry["kernel"],
        fallback=bool(entry.get("fallback", False)),
        rejections=tuple(Rejection(r["kernel"], r["reason"]) for r in entry.get("rejected", ())),
        verification=text,
        verified_ok=ok,
    )


def grid_from_manifests(artifacts: Iterable[tuple[str, int, Mapping[str, Any]]]) -> PlanGrid:
    """A grid of what was converted: (artifact id, size in bytes, manifest) per target, layers and
    expert groups in manifest order, each cell with its verification result."""
    columns: dict[str, dict[str, Cell]] = {}
    summaries: dict[str, TargetSummary] = {}
    for artifact_id, size, manifest in artifacts:
        target = str(manifest["target"])
        entries = {
            **manifest.get("layers", {}),
            **manifest.get("expert_groups", {}),
            **manifest.get("derived", {}),  # MLA's absorbed matrices: rows of the plan too
        }
        columns[target] = {name: _manifest_cell(e) for name, e in entries.items()}
        summaries[target] = TargetSummary(
            target=target,
            fallbacks=sum(bool(e.get("fallback")) for e in entries.values()),
            layers=len(entries),
            size_bytes=size,
            artifact_id=artifact_id,
        )
    return _grid(columns, summaries)


@dataclass(frozen=True)
class ArtifactView:
    id: str
    model: str
    source_uri: str
    source_format: str
    target: str
    method: str
    tp: int
    expert_parallel: bool
    size_bytes: int
    checksum: str  # sha256 of the artifact's manifest.json (which lists every file's sha256)
    uri: str
    job_id: str | None

    @property
    def parallelism(self) -> str:
        return f"EP {self.tp}" if self.expert_parallel else f"TP {self.tp}"

    @property
    def serve_commands(self) -> list[str]:
        """How to serve it: Kiln's runtime (it starts a sharded artifact's ranks itself) and vLLM
        through Kiln's plugin, with the parallelism the artifact was converted for."""
        vllm = f"vllm serve {self.uri} --load-format kiln"
        if self.tp > 1:
            vllm += f" --tensor-parallel-size {self.tp}"
        if self.expert_parallel:
            vllm += " --enable-expert-parallel"
        return [f"kiln serve {self.uri}", vllm]


@dataclass
class ArtifactMatrix:
    """Models as rows, targets as columns; each cell the artifacts of that model for that target."""

    targets: list[str]
    rows: list[tuple[str, list[list[ArtifactView]]]]


def artifact_matrix(artifacts: Iterable[ArtifactView]) -> ArtifactMatrix:
    items = list(artifacts)
    targets = _ordered_targets(a.target for a in items)
    models = sorted({a.model for a in items})
    rows = []
    for model in models:
        cells = [
            sorted(
                (a for a in items if a.model == model and a.target == t),
                key=lambda a: (a.method, a.tp, a.expert_parallel, a.id),
            )
            for t in targets
        ]
        rows.append((model, cells))
    return ArtifactMatrix(targets=targets, rows=rows)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
