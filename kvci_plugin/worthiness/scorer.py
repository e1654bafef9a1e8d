"""The contract every checkpoint-worthiness scorer meets."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.signal import CheckpointSignal


@runtime_checkable
class CheckpointScorer(Protocol):
    """Scores one observation.

    ``name`` identifies the scorer in the registry and on every recommendation; ``weight`` is its
    default weight in the aggregate (finite, >= 0). ``score`` returns a signal with the same
    name; it abstains (``value=None``) rather than guess when its inputs were not measured.
    """

    name: str
    weight: float

    def score(self, observation: CheckpointObservation) -> CheckpointSignal: ...
