"""Small real scorers with a fixed answer, for building registries in tests."""

from __future__ import annotations

from dataclasses import dataclass

from kvci_plugin.worthiness import (
    CheckpointObservation,
    CheckpointScorerRegistry,
    CheckpointSignal,
    SignalKind,
)


@dataclass
class FixedScorer:
    name: str
    weight: float
    value: float | None
    veto: bool = False

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return CheckpointSignal(
            name=self.name,
            kind=SignalKind.OPPORTUNITY,
            value=self.value,
            reason=f"fixed at {self.value}",
            veto=self.veto,
        )


@dataclass
class RaisingScorer:
    name: str = "flaky"
    weight: float = 0.5

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        raise RuntimeError("backend unreachable")


def registry_of(*scorers: object) -> CheckpointScorerRegistry:
    return CheckpointScorerRegistry(scorers)  # type: ignore[arg-type]
