"""The manifest of a converted artifact, from its plan, the units' entries and the staged files."""

from __future__ import annotations

from datetime import UTC, datetime

from runtime.artifact.manifest import (
    DERIVED_SCHEMA_VERSION,
    MOE_SCHEMA_VERSION,
    SCHEMA_VERSION,
    DerivedEntry,
    ExpertGroupEntry,
    FileEntry,
    LayerEntry,
    Manifest,
    SourceInfo,
    Verification,
    source_digest,
)
from runtime.version import kiln_version
from services.convert.plan import Plan
from services.convert.units.base import UnitEntry


def build_manifest(
    plan: Plan,
    hf_config: dict,
    aid: str,
    hashes: dict[str, str],
    files: list[FileEntry],
    entries: dict[str, dict[str, UnitEntry]],
    seconds: float,
) -> Manifest:
    """`entries`: each manifest section's unit entries by unit name (`PlanUnit.section`)."""
    layers: dict[str, LayerEntry] = entries.get("layers", {})  # type: ignore[assignment]
    groups: dict[str, ExpertGroupEntry] = entries.get("expert_groups", {})  # type: ignore[assignment]
    derived: dict[str, DerivedEntry] = entries.get("derived", {})  # type: ignore[assignment]
    schema = DERIVED_SCHEMA_VERSION if derived else MOE_SCHEMA_VERSION if groups else SCHEMA_VERSION
    checks = [
        e.verification for section in entries.values() for e in section.values() if e.verification is not None
    ]
    return Manifest(
        schema_version=schema,
        artifact_id=aid,
        kiln_version=kiln_version(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        source=SourceInfo(
            uri=plan.source,
            format=plan.format,
            digest=source_digest(hashes),
            files=hashes,
            quantization=plan.quantization,
        ),
        target=plan.target,
        tp=plan.tp,
        method=plan.method,
        options=plan.options,
        architecture=plan.model.architecture,
        act_dtype=plan.act_dtype,  # type: ignore[arg-type]
        hf_config=hf_config,
        layers=layers,
        other_tensors=plan.other_tensors,
        expert_groups=groups,
        expert_parallel=plan.expert_parallel,
        derived=derived,
        files=files,
        verification=Verification(
            ok=all(c.ok for c in checks),
            layers_checked=len(checks),
            layers_exact=sum(c.metric == "exact" for c in checks),
            max_rel_err=max((c.value for c in checks if c.metric == "max_rel_err"), default=0.0),
            seconds=round(seconds, 3),
        ),
    )
