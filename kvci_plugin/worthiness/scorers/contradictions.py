"""contradictions: the one default veto; a clean context scores 1."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

CONTRADICTIONS = "contradictions"

# Unresolved contradictions at which the value halves: a single open conflict already makes the
# context half as trustworthy to freeze as a clean one.
HALF_UNRESOLVED_CONTRADICTIONS = 1.0


class ContradictionsScorer:
    """Value = 1 / (1 + unresolved / HALF_UNRESOLVED_CONTRADICTIONS); 1.0 for a clean context.

    Any unresolved high-severity contradiction vetoes (value 0). Abstains when the unresolved
    count was not measured and no high-severity one was reported.
    """

    name = CONTRADICTIONS
    weight = 0.15

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return _signal(
            observation.contradictions_unresolved, observation.contradictions_high_severity
        )


@memoised
def _signal(unresolved: int | None, high: int | None) -> CheckpointSignal:
    if high:
        return CheckpointSignal(
            name=CONTRADICTIONS,
            kind=SignalKind.GATE,
            value=0.0,
            reason=f"{high} unresolved high-severity contradictions",
            veto=True,
        )
    if unresolved is None:
        return CheckpointSignal(
            name=CONTRADICTIONS,
            kind=SignalKind.GATE,
            value=None,
            reason="unresolved contradictions not measured",
        )
    severity = "" if high is not None else "; severity not measured"
    return CheckpointSignal(
        name=CONTRADICTIONS,
        kind=SignalKind.GATE,
        value=1.0 / (1.0 + unresolved / HALF_UNRESOLVED_CONTRADICTIONS),
        reason=f"{unresolved} unresolved contradictions{severity}",
    )
