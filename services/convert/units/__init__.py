"""The kinds of unit a conversion plan holds, in plan (and rank file) order. A new kind of block is a
module implementing `services.convert.units.base.UnitKind` / `PlanUnit` and one line here."""

from __future__ import annotations

from services.convert.units.base import PlanUnit, UnitKind
from services.convert.units.experts import ExpertGroupKind
from services.convert.units.linear import LinearKind
from services.convert.units.mla import AbsorbedMlaKind

UNIT_KINDS: tuple[UnitKind, ...] = (
    LinearKind(),
    ExpertGroupKind(),
    AbsorbedMlaKind(),
)

__all__ = ["UNIT_KINDS", "PlanUnit", "UnitKind"]
