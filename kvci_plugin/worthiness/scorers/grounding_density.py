"""grounding_density: claims backed by cited evidence rather than speculation."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

GROUNDING_DENSITY = "grounding_density"

# Evidence spans per claim at which the value saturates at 1: one cited span makes a claim
# grounded rather than speculative; more spans corroborate it but do not make it more grounded.
FULL_GROUNDING_SPANS_PER_CLAIM = 1.0


class GroundingDensityScorer:
    """Value = min(1, (evidence_spans / claims) / FULL_GROUNDING_SPANS_PER_CLAIM).

    Abstains when either count is unmeasured or no claim was made (density is undefined).
    """

    name = GROUNDING_DENSITY
    weight = 0.15

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return _signal(observation.evidence_spans, observation.claims)


@memoised
def _signal(spans: int | None, claims: int | None) -> CheckpointSignal:
    if claims == 0 or claims is None or spans is None:
        reason = "no claims made" if claims == 0 else "evidence span or claim counts not measured"
        return CheckpointSignal(
            name=GROUNDING_DENSITY, kind=SignalKind.OPPORTUNITY, value=None, reason=reason
        )
    return CheckpointSignal(
        name=GROUNDING_DENSITY,
        kind=SignalKind.OPPORTUNITY,
        value=min(1.0, spans / claims / FULL_GROUNDING_SPANS_PER_CLAIM),
        reason=f"{spans} evidence spans for {claims} claims",
    )
