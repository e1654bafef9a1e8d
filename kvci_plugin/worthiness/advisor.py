"""Turns the registered scorers' signals into one recommendation.

The aggregate is the weighted mean over the signals that answered (abstentions move it neither
way). A veto forces NONE; the model's self-report alone never recommends; a scorer that raises
is a loud abstention (WARNING log + ``scorer_errors``), never a silent zero. The connector calls
``recommend`` for every finished request, so this path stays lean.
"""

from __future__ import annotations

import logging
import math

from kvci_plugin.worthiness.disk_rule import DiskPromotionRule
from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.recommendation import (
    CheckpointRecommendation,
    CheckpointTier,
    Driver,
    ScorerError,
)
from kvci_plugin.worthiness.registry import (
    CheckpointScorerRegistry,
    RegisteredScorer,
    default_registry,
)
from kvci_plugin.worthiness.scorers import MODEL_SELF_REPORT
from kvci_plugin.worthiness.signal import CheckpointSignal

logger = logging.getLogger(__name__)

# A RAM checkpoint is cheap and bounded (LRU evicts it if nothing reuses it), so the bar is
# "the evidence leans worthy": a little above 0.5, where most signals put "no opinion either
# way" (e.g. rebuild cost at an 8k-token context). Disk's bar lives in DiskPromotionRule.
DEFAULT_RAM_THRESHOLD = 0.55
DEFAULT_MAX_DRIVERS = 3
_MAX_ERROR_MESSAGE = 500


class CheckpointAdvisor:
    """Scores observations with a registry's scorers and recommends a tier: NONE, RAM or DISK."""

    def __init__(
        self,
        registry: CheckpointScorerRegistry | None = None,
        *,
        ram_threshold: float = DEFAULT_RAM_THRESHOLD,
        disk_threshold: float | None = None,
        disk_rule: DiskPromotionRule | None = None,
        max_drivers: int = DEFAULT_MAX_DRIVERS,
    ) -> None:
        """``disk_threshold`` is the disk rule's aggregate floor: give it or a whole
        ``disk_rule``."""
        if disk_threshold is not None and disk_rule is not None:
            raise ValueError(
                "give disk_threshold or disk_rule (whose aggregate_floor it is), not both"
            )
        if disk_rule is None:
            disk_rule = (
                DiskPromotionRule()
                if disk_threshold is None
                else DiskPromotionRule(aggregate_floor=disk_threshold)
            )
        ram_threshold = _ram_threshold(ram_threshold, disk_rule.aggregate_floor)
        if isinstance(max_drivers, bool) or not isinstance(max_drivers, int) or max_drivers < 0:
            raise ValueError(f"max_drivers must be an integer >= 0, got {max_drivers!r}")
        self.registry = registry if registry is not None else default_registry()
        self.ram_threshold = ram_threshold
        self.disk_rule = disk_rule
        self.max_drivers = max_drivers

    @property
    def disk_threshold(self) -> float:
        return self.disk_rule.aggregate_floor

    def recommend(
        self, observation: CheckpointObservation, *, ram_threshold: float | None = None
    ) -> CheckpointRecommendation:
        """``ram_threshold`` replaces the advisor's own for this call (a tier that follows its own
        pressure moves the bar); it must lie in (0, disk threshold] like the advisor's."""
        if not isinstance(observation, CheckpointObservation):
            raise TypeError(
                f"observation must be a CheckpointObservation, got {type(observation).__name__}"
            )
        threshold = (
            self.ram_threshold
            if ram_threshold is None
            else _ram_threshold(ram_threshold, self.disk_threshold)
        )
        # One pass over the registry snapshot: run, aggregate, sort out abstentions and vetoes.
        signals: list[CheckpointSignal] = []
        by_name: dict[str, CheckpointSignal] = {}
        weights: dict[str, float] = {}
        abstained: list[str] = []
        vetoes: list[CheckpointSignal] = []
        errors: list[ScorerError] = []
        # (contribution, weight, value, signal) of each answer with a positive weight.
        live: list[tuple[float, float, float, CheckpointSignal]] = []
        total = weighted = 0.0
        for entry in self.registry.entries():
            name = entry.name
            weight = entry.weight
            weights[name] = weight
            signal = _run(entry, observation, errors)
            if signal is None:
                abstained.append(name)
                continue
            signals.append(signal)
            by_name[name] = signal
            if signal.veto:
                vetoes.append(signal)
            value = signal.value
            if value is None:
                abstained.append(name)
            elif weight > 0.0:
                total += weight
                weighted += weight * value
                live.append((weight * value, weight, value, signal))
        score = min(1.0, weighted / total) if total > 0.0 else None

        blockers = [f"vetoed by {signal.name}: {signal.reason}" for signal in vetoes]
        if score is None:
            blockers.append("no evidence: no scorer with a positive weight answered")
        elif len(live) == 1 and live[0][3].name == MODEL_SELF_REPORT:
            blockers.append(
                f"{MODEL_SELF_REPORT} is the only evidence: the model's opinion is evidence, not "
                "authority"
            )
        elif score < threshold:
            blockers.append(
                f"ram not recommended — score {score:.2f} below the ram threshold {threshold:.2f}"
            )
        ram_blocked = bool(blockers)
        disk_failures = self.disk_rule.failures(score, by_name)
        blockers.extend(disk_failures)
        if ram_blocked:
            tier = CheckpointTier.NONE
        elif disk_failures:
            tier = CheckpointTier.RAM
        else:
            tier = CheckpointTier.DISK

        live.sort(key=_contribution, reverse=True)
        drivers = tuple(
            Driver(
                name=signal.name, kind=signal.kind, value=value, weight=weight, reason=signal.reason
            )
            for _, weight, value, signal in live[: self.max_drivers]
        )
        return CheckpointRecommendation(
            score=score,
            tier=tier,
            drivers=drivers,
            blockers=tuple(blockers),
            abstained=tuple(abstained),
            vetoed_by=tuple(signal.name for signal in vetoes),
            scorer_errors=tuple(errors),
            signals=tuple(signals),
            weights=weights,
            ram_threshold=threshold,
            disk_threshold=self.disk_rule.aggregate_floor,
        )


def _ram_threshold(value: object, disk_threshold: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ram_threshold must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and 0.0 < value <= disk_threshold):
        raise ValueError(
            f"ram_threshold must be in (0, disk threshold {disk_threshold}], got {value!r}"
        )
    return float(value)


def _contribution(item: tuple[float, float, float, CheckpointSignal]) -> float:
    return item[0]


def _run(
    entry: RegisteredScorer, observation: CheckpointObservation, errors: list[ScorerError]
) -> CheckpointSignal | None:
    """The scorer's signal, or None (recorded in ``errors`` and logged) when it failed."""
    try:
        signal = entry.scorer.score(observation)
        if not isinstance(signal, CheckpointSignal):
            raise TypeError(f"score() returned {type(signal).__name__}, not a CheckpointSignal")
        if signal.name != entry.name:
            raise ValueError(f"score() returned a signal named {signal.name!r}")
    except Exception as exc:
        message = str(exc)[:_MAX_ERROR_MESSAGE]
        logger.warning(
            "checkpoint scorer %r raised %s: %s — recorded as an abstention",
            entry.name,
            type(exc).__name__,
            message,
        )
        errors.append(ScorerError(name=entry.name, error_type=type(exc).__name__, message=message))
        return None
    return signal
