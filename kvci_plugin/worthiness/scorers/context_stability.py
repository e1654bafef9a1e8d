"""context_stability: a recently churned context is not worth freezing."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

CONTEXT_STABILITY = "context_stability"

# Rewrites + evictions in the caller's window at which the churn factor halves: two changes in
# a window mean the context is still being reshaped.
HALF_CHURN_CHANGES = 2.0
# Turns without a change at which the settledness factor reaches 0.5: a context unchanged for
# two turns has started to stop moving; a context changed this turn has not.
HALF_SETTLED_TURNS = 2.0


class ContextStabilityScorer:
    """Value = product of the measured factors (both must hold for a context to be stable):

    churn factor   = 1 / (1 + (rewrites + evictions) / HALF_CHURN_CHANGES)
    settled factor = turns / (turns + HALF_SETTLED_TURNS)

    Falls with rewrites and evictions, rises with turns since the last change. Abstains when
    none of the three was measured.
    """

    name = CONTEXT_STABILITY
    weight = 0.10

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return _signal(
            observation.context_rewrites,
            observation.context_evictions,
            observation.turns_since_change,
        )


@memoised
def _signal(rewrites: int | None, evictions: int | None, turns: int | None) -> CheckpointSignal:
    if rewrites is None and evictions is None and turns is None:
        return CheckpointSignal(
            name=CONTEXT_STABILITY,
            kind=SignalKind.RISK,
            value=None,
            reason="no rewrite, eviction or turn counts",
        )
    value = 1.0
    parts = []
    if rewrites is not None or evictions is not None:
        value /= 1.0 + ((rewrites or 0) + (evictions or 0)) / HALF_CHURN_CHANGES
        parts.append("rewrites not measured" if rewrites is None else f"{rewrites} rewrites")
        parts.append("evictions not measured" if evictions is None else f"{evictions} evictions")
    if turns is not None:
        value *= turns / (turns + HALF_SETTLED_TURNS)
        parts.append(f"unchanged for {turns} turns")
    return CheckpointSignal(
        name=CONTEXT_STABILITY, kind=SignalKind.RISK, value=value, reason=", ".join(parts)
    )
