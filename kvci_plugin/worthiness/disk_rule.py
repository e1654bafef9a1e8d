"""When a checkpoint is worth a disk write: a materially higher bar than RAM.

The rule is literal: high rebuild cost AND high predicted reuse AND a stable context AND an
aggregate floor. An abstaining (or unregistered) signal fails its requirement: "we don't know"
is not "it's high". Satisfying the rule only recommends disk; the eligibility gate still decides
whether anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvci_plugin.worthiness.scorers import CONTEXT_STABILITY, PREDICTED_REUSE, REBUILD_COST
from kvci_plugin.worthiness.signal import CheckpointSignal

UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]

_PREFIX = "disk not recommended — "


class DiskPromotionRule(BaseModel):
    """The disk bar: minimum values of three named signals, and of the aggregate."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    # 0.6 = a rebuild of >= 1.5 s (~12k tokens at the default prefill rate): short contexts
    # recompute faster than a file tier loads them (HiCache's file tier lost to recompute at 8k).
    rebuild_cost_min: UnitFloat = 0.6
    # 0.5 = two expected reuses: a single reuse is served by RAM; disk is for recurring prefixes
    # (Dynamo KVBM likewise writes to disk only blocks seen at least twice).
    predicted_reuse_min: UnitFloat = 0.5
    # 0.6 = e.g. no churn and unchanged for three turns: a context still moving wears the disk
    # with checkpoints that the next turn supersedes.
    stability_min: UnitFloat = 0.6
    # The aggregate score a disk recommendation needs on top of the three requirements.
    aggregate_floor: UnitFloat = 0.75

    def failures(
        self, score: float | None, signals: Mapping[str, CheckpointSignal]
    ) -> tuple[str, ...]:
        """Every unmet requirement, each naming itself; empty when disk is recommended."""
        failed = [
            failure
            for failure in (
                _requirement(signals, REBUILD_COST, self.rebuild_cost_min),
                _requirement(signals, PREDICTED_REUSE, self.predicted_reuse_min),
                _requirement(signals, CONTEXT_STABILITY, self.stability_min),
            )
            if failure is not None
        ]
        if score is None:
            failed.append(f"{_PREFIX}no aggregate score")
        elif score < self.aggregate_floor:
            failed.append(
                f"{_PREFIX}score {score:.2f} below the disk floor {self.aggregate_floor:.2f}"
            )
        return tuple(failed)

    @model_validator(mode="after")
    def _floor_is_a_real_bar(self) -> DiskPromotionRule:
        if self.aggregate_floor <= 0.0:
            raise ValueError("aggregate_floor must be > 0: disk must never be the default outcome")
        return self


def _requirement(signals: Mapping[str, CheckpointSignal], name: str, minimum: float) -> str | None:
    signal = signals.get(name)
    if signal is None:
        return f"{_PREFIX}{name}: not registered"
    if signal.value is None:
        return f"{_PREFIX}{name}: abstained ({signal.reason})"
    if signal.value < minimum:
        return f"{_PREFIX}{name} {signal.value:.2f} below {minimum:.2f} ({signal.reason})"
    return None
