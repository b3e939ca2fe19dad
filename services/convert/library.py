"""The conversion library's entry points (used by the CLI, the API worker and the demo).

    plan(source, target, tp=1, method="auto", fp8_scheme="tensor") -> Plan
    convert(ConversionRequest, progress=..., should_cancel=...) -> list[ConversionResult]

Pure library: no FastAPI, no Celery. Artifacts land at `{out}/{artifact_id}/`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kernels.base import Target
from services.convert.checkpoint import Checkpoint, gguf_in, open_checkpoint
from services.convert.choices import Fp8Scheme, GpuLayout, HeadQuant, Method
from services.convert.detect import detect_format
from services.convert.errors import Cancelled, ConversionError, NotACheckpointError, VerificationError
from services.convert.formats.base import CheckpointFormat
from services.convert.gguf.checkpoint import open_gguf_checkpoint
from services.convert.pipeline import CancelFn, ConversionResult, Progress, ProgressFn, convert_plan
from services.convert.plan import Plan, PlanRow, build_plan
from services.convert.spec import ConversionSpec, conversion_spec
from services.convert.spec import disabled_kernels as effective_disabled_kernels
from services.convert.stacked_experts import per_expert_view
from services.settings import ServiceSettings, get_settings
from services.storage import open_source, open_store
from services.storage.local import STAGING_DIR, LocalStore

log = logging.getLogger(__name__)

__all__ = [
    "Cancelled",
    "ConversionError",
    "ConversionRequest",
    "ConversionResult",
    "Plan",
    "PlanRow",
    "Progress",
    "VerificationError",
    "convert",
    "open_and_detect",
    "parse_targets",
    "plan",
]


@dataclass
class ConversionRequest:
    """One conversion: `targets` may be given as names ("sm80", "sm80,cpu"); they are parsed into
    `Target`s here, once, and travel as such from then on."""

    source: str
    targets: list[Target]
    method: Method = "auto"
    tp: int = 1  # ranks (with expert_parallel: the experts are placed whole over them)
    fp8_scheme: Fp8Scheme = "tensor"
    out: str = ""  # empty: ServiceSettings.resolved_store_url
    disabled_kernels: tuple[str, ...] = field(default_factory=tuple)
    expert_parallel: bool = False
    quantize_head: HeadQuant | None = None  # None: the target's default (services/convert/cpu_defaults.py)
    int8_activations: bool | None = None  # None: the target's default
    gpu_layout: GpuLayout | None = None  # None: marlin

    def __post_init__(self) -> None:
        self.targets = parse_targets(self.targets)

    def spec(self) -> ConversionSpec:
        options = {
            "fp8_scheme": self.fp8_scheme,
            "disabled_kernels": list(self.disabled_kernels),
            "expert_parallel": self.expert_parallel,
            "quantize_head": self.quantize_head,
            "int8_activations": self.int8_activations,
            "gpu_layout": self.gpu_layout,
        }
        return conversion_spec(
            source=self.source, targets=self.targets, method=self.method, tp=self.tp, options=options
        )

    @classmethod
    def from_spec(cls, spec: ConversionSpec, *, out: str = "") -> ConversionRequest:
        """The library call of a conversion spec (`out`: the artifact store; empty: the settings')."""
        o = spec.options
        return cls(
            spec.source, list(spec.targets), spec.method, spec.tp, o.fp8_scheme, out,
            tuple(o.disabled_kernels), o.expert_parallel, o.quantize_head, o.int8_activations, o.gpu_layout,
        )  # fmt: skip


def parse_targets(targets: Iterable[str | Target] | str) -> list[Target]:
    """["sm80,sm90", "cpu"] -> [SM80, SM90, CPU] (deduplicated, order kept); unknown names refused."""
    items = [targets] if isinstance(targets, str) else targets
    out: list[Target] = []
    for item in items:
        for name in str(item).split(","):
            if name.strip() and (t := Target.parse(name)) not in out:
                out.append(t)
    if not out:
        raise ConversionError("no target given; use e.g. --target sm80 or --target sm80,cpu")
    return out


def open_and_detect(
    source: str, settings: ServiceSettings | None = None
) -> tuple[Checkpoint, CheckpointFormat]:
    folder, file = source.rsplit("/", 1) if source.endswith(".gguf") else (source, None)
    reader = open_source(folder, settings or get_settings())
    file = file or gguf_in(reader, set(reader.list()))
    if file is not None and not reader.exists(file):
        raise NotACheckpointError(f"{source}: no such GGUF file")
    if file is not None:
        ckpt: Checkpoint = open_gguf_checkpoint(reader, file)
    else:
        ckpt = per_expert_view(open_checkpoint(reader))
    return ckpt, detect_format(ckpt)


def plan(
    source: str,
    target: Target | str,
    *,
    tp: int = 1,
    method: Method = "auto",
    fp8_scheme: Fp8Scheme = "tensor",
    disabled_kernels: tuple[str, ...] = (),
    expert_parallel: bool = False,
    quantize_head: HeadQuant | None = None,
    int8_activations: bool | None = None,
    gpu_layout: GpuLayout | None = None,
    settings: ServiceSettings | None = None,
) -> Plan:
    """The plan of one target (a convenience over `plan_targets`)."""
    options = {
        "fp8_scheme": fp8_scheme,
        "disabled_kernels": list(disabled_kernels),
        "quantize_head": quantize_head,
        "int8_activations": int8_activations,
        "gpu_layout": gpu_layout,
    }
    spec = conversion_spec(
        source=source,
        targets=parse_targets([target]),
        method=method,
        tp=tp,
        options={**options, "expert_parallel": expert_parallel},
    )
    (result,) = plan_targets(spec, settings=settings)
    return result


def plan_targets(spec: ConversionSpec, *, settings: ServiceSettings | None = None) -> list[Plan]:
    """One plan per target from one read of the checkpoint's config and headers (`kiln plan`,
    `POST /v1/plans`), leaving out the kernels the conversion leaves out."""
    settings = settings or get_settings()
    ckpt, fmt = open_and_detect(spec.source, settings)
    return [_build_plan(ckpt, fmt, t, spec, settings) for t in spec.targets]


def _build_plan(
    ckpt: Checkpoint, fmt: CheckpointFormat, target: Target, spec: ConversionSpec, settings: ServiceSettings
) -> Plan:
    o = spec.options
    return build_plan(
        ckpt,
        fmt,
        target,
        tp=spec.tp,
        method=spec.method,
        fp8_scheme=o.fp8_scheme,
        disabled_kernels=effective_disabled_kernels(o.disabled_kernels, settings.disabled_kernels),
        expert_parallel=o.expert_parallel,
        quantize_head=o.quantize_head,
        int8_activations=o.int8_activations,
        gpu_layout=o.gpu_layout,
    )


def convert(
    req: ConversionRequest,
    *,
    progress: ProgressFn | None = None,
    should_cancel: CancelFn | None = None,
    settings: ServiceSettings | None = None,
    workdir: Path | None = None,
) -> list[ConversionResult]:
    """Convert `req.source` for every target; one artifact per target (reused when already committed)."""
    settings = settings or get_settings()
    ckpt, fmt = open_and_detect(req.source, settings)
    plans = [_build_plan(ckpt, fmt, t, req.spec(), settings) for t in req.targets]
    store = open_store(req.out or settings.resolved_store_url, settings)
    if progress:
        progress(Progress("hashing", 0, 0, 0, ckpt.total_bytes, "sha256 of the sources, while converting"))
    ckpt.start_hashing()
    if workdir is None and isinstance(store, LocalStore):
        workdir = store.root / STAGING_DIR  # same filesystem: finished rank files are renamed, not copied
        workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for p in plans:
        log.info("converting %s for %s (tp=%d, method=%s)", req.source, p.target.value, p.tp, p.method)
        results.append(
            convert_plan(ckpt, fmt, p, store, progress=progress, should_cancel=should_cancel, workdir=workdir)
        )
    return results
