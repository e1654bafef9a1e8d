"""The advisor's verdict: score, tier, and everything needed to explain it."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvci_plugin.worthiness.scorers.model_self_report import MODEL_SELF_REPORT
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

# Not strict: these models are produced here and read back from JSON or plain dicts by
# consumers (REST, catalog), where the tier arrives as its string value.
_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]


class CheckpointTier(str, Enum):
    NONE = "none"
    RAM = "ram"
    DISK = "disk"


class Driver(BaseModel):
    """A signal that contributed most to the score."""

    model_config = _FROZEN

    name: str
    kind: SignalKind
    value: UnitFloat
    weight: Annotated[float, Field(ge=0.0)]
    reason: str


class ScorerError(BaseModel):
    """A scorer that raised; it was recorded as an abstention."""

    model_config = _FROZEN

    name: str
    error_type: str
    message: str


class CheckpointRecommendation(BaseModel):
    model_config = _FROZEN

    # Weighted mean over the non-abstaining, positively weighted signals; None when there were none.
    score: UnitFloat | None
    tier: CheckpointTier
    drivers: tuple[Driver, ...] = ()
    # Every reason a higher tier was not recommended.
    blockers: tuple[str, ...] = ()
    abstained: tuple[str, ...] = ()
    vetoed_by: tuple[str, ...] = ()
    scorer_errors: tuple[ScorerError, ...] = ()
    signals: tuple[CheckpointSignal, ...] = ()
    # The weight each registered scorer had in this aggregate, by name.
    weights: dict[str, Annotated[float, Field(ge=0.0)]] = Field(default_factory=dict)
    ram_threshold: UnitFloat
    disk_threshold: UnitFloat

    @property
    def worth_it(self) -> bool:
        return self.tier is not CheckpointTier.NONE

    @property
    def held_back_by_threshold(self) -> bool:
        """Not recommended only because the score is under the RAM threshold: a lower bar would
        recommend it. Never true for a veto, for no evidence, or for the self-report alone."""
        if self.tier is not CheckpointTier.NONE or self.score is None or self.vetoed_by:
            return False
        if self.score >= self.ram_threshold:
            return False
        live = [
            s.name
            for s in self.signals
            if s.value is not None and self.weights.get(s.name, 0.0) > 0.0
        ]
        return live != [MODEL_SELF_REPORT]
