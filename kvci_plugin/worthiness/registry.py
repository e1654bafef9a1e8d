"""Which scorers produce a recommendation, and how much each weighs."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kvci_plugin.worthiness.scorer import CheckpointScorer
from kvci_plugin.worthiness.scorers import (
    ContextStabilityScorer,
    ContradictionsScorer,
    GroundingDensityScorer,
    ModelSelfReportScorer,
    PhaseBoundaryScorer,
    PredictedReuseScorer,
    RebuildCostScorer,
    RetrievalSaturationScorer,
)

_MAX_NAME_LENGTH = 64


@dataclass(frozen=True, slots=True)
class RegisteredScorer:
    name: str
    weight: float
    scorer: CheckpointScorer


class CheckpointScorerRegistry:
    """An ordered set of scorers keyed by name.

    Mutations swap in a new immutable snapshot under a lock, so an advisor scoring on another
    thread always sees one consistent set and never takes the lock.
    """

    def __init__(self, scorers: Iterable[CheckpointScorer] = ()) -> None:
        self._lock = threading.Lock()
        self._entries: tuple[RegisteredScorer, ...] = ()
        for scorer in scorers:
            self.register(scorer)

    def register(self, scorer: CheckpointScorer, *, weight: float | None = None) -> None:
        """Add a scorer; its own ``weight`` applies unless ``weight`` is given."""
        entry = _entry(scorer, weight)
        with self._lock:
            if any(existing.name == entry.name for existing in self._entries):
                raise ValueError(
                    f"a scorer named {entry.name!r} is already registered; use replace()"
                )
            self._entries = (*self._entries, entry)

    def unregister(self, name: str) -> CheckpointScorer:
        """Remove the scorer named ``name`` and return it."""
        with self._lock:
            index = self._index(name)
            removed = self._entries[index]
            self._entries = self._entries[:index] + self._entries[index + 1 :]
        return removed.scorer

    def replace(self, scorer: CheckpointScorer, *, weight: float | None = None) -> CheckpointScorer:
        """Swap the registered scorer of the same name, keeping its position; return the old one."""
        entry = _entry(scorer, weight)
        with self._lock:
            index = self._index(entry.name)
            old = self._entries[index]
            self._entries = (*self._entries[:index], entry, *self._entries[index + 1 :])
        return old.scorer

    def set_weight(self, name: str, weight: float) -> None:
        checked = _checked_weight(weight, name)
        with self._lock:
            index = self._index(name)
            old = self._entries[index]
            entry = RegisteredScorer(old.name, checked, old.scorer)
            self._entries = (*self._entries[:index], entry, *self._entries[index + 1 :])

    def weight(self, name: str) -> float:
        return self._entries[self._index(name)].weight

    def names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self._entries)

    def entries(self) -> tuple[RegisteredScorer, ...]:
        """The current snapshot, in registration order."""
        return self._entries

    def __contains__(self, name: object) -> bool:
        return any(entry.name == name for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _index(self, name: str) -> int:
        for index, entry in enumerate(self._entries):
            if entry.name == name:
                return index
        raise KeyError(
            f"no scorer named {name!r} is registered (registered: "
            f"{', '.join(self.names()) or 'none'})"
        )


def default_registry() -> CheckpointScorerRegistry:
    """A fresh registry holding the default signal set and weights (they sum to 1)."""
    return CheckpointScorerRegistry(
        [
            RebuildCostScorer(),
            PredictedReuseScorer(),
            RetrievalSaturationScorer(),
            GroundingDensityScorer(),
            ContradictionsScorer(),
            ContextStabilityScorer(),
            PhaseBoundaryScorer(),
            ModelSelfReportScorer(),
        ]
    )


def _entry(scorer: CheckpointScorer, weight: float | None) -> RegisteredScorer:
    name = getattr(scorer, "name", None)
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME_LENGTH:
        raise TypeError(
            f"scorer {type(scorer).__name__} needs a non-empty str name of at most "
            f"{_MAX_NAME_LENGTH} characters, got {name!r}"
        )
    if not callable(getattr(scorer, "score", None)):
        raise TypeError(f"scorer {name!r} has no callable score(observation)")
    if weight is None:
        if not hasattr(scorer, "weight"):
            raise TypeError(f"scorer {name!r} has no weight attribute and no weight was given")
        weight = scorer.weight
    return RegisteredScorer(name, _checked_weight(weight, name), scorer)


def _checked_weight(weight: object, name: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(f"weight of scorer {name!r} must be a number, got {type(weight).__name__}")
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"weight of scorer {name!r} must be finite and >= 0, got {weight!r}")
    return float(weight)
