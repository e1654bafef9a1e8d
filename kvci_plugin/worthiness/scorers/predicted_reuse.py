"""predicted_reuse: how many later requests are expected to start from this context."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

PREDICTED_REUSE = "predicted_reuse"

# Expected reuses at which the value saturates at 1. A RAM checkpoint pays for itself on its
# first reuse; by four reuses a disk checkpoint has too (a disk load costs a fraction of a
# re-prefill), so further reuses add no information about whether to keep it.
REUSE_SATURATION_COUNT = 4.0


class PredictedReuseScorer:
    """Value = min(1, expected / REUSE_SATURATION_COUNT).

    ``expected`` is the larger of the caller's prediction (sibling + queued tasks that would
    start from this context) and the reuse observed so far (``observed_reuse``: re-sends of
    this context, a context re-sent before being likelier to be re-sent again). The larger,
    because both estimate the same future hits and may count the same requests. Abstains when
    neither was supplied: nothing here predicts reuse by itself.
    """

    name = PREDICTED_REUSE
    weight = 0.15

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return _signal(
            observation.sibling_tasks, observation.queued_tasks, observation.observed_reuse
        )


@memoised
def _signal(siblings: int | None, queued: int | None, observed: int | None) -> CheckpointSignal:
    if siblings is None and queued is None and observed is None:
        return CheckpointSignal(
            name=PREDICTED_REUSE,
            kind=SignalKind.OPPORTUNITY,
            value=None,
            reason="no sibling, queued or observed reuse counts",
        )
    predicted = (siblings or 0) + (queued or 0)
    expected = max(predicted, observed or 0)
    parts = []
    if siblings is not None or queued is not None:
        parts.append(f"{predicted} related tasks would reuse this context")
    if observed is not None:
        parts.append(f"{observed} later requests reused it")
    return CheckpointSignal(
        name=PREDICTED_REUSE,
        kind=SignalKind.OPPORTUNITY,
        value=min(1.0, expected / REUSE_SATURATION_COUNT),
        reason="; ".join(parts),
    )
