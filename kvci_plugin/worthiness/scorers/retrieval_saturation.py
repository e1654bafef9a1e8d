"""retrieval_saturation: whether retrieval has converged (new items are no longer new)."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

RETRIEVAL_SATURATION = "retrieval_saturation"

# Laplace prior, in items, on each side: a handful of already-known items is not yet proof of
# convergence, so small samples are pulled towards 0.5 and only many known items approach 1.
SATURATION_PRIOR_ITEMS = 1.0


class RetrievalSaturationScorer:
    """Value = (known + prior) / (retrieved + 2 * prior), known = retrieved - novel.

    Rises with the items retrieved and falls with the novel ones: rising novelty means the run
    is still exploring, a bad moment to freeze. Abstains when either count is unmeasured or
    nothing was retrieved.
    """

    name = RETRIEVAL_SATURATION
    weight = 0.15

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return _signal(observation.retrieved_items, observation.novel_items)


@memoised
def _signal(retrieved: int | None, novel: int | None) -> CheckpointSignal:
    if retrieved == 0 or retrieved is None or novel is None:
        reason = (
            "nothing retrieved" if retrieved == 0 else "retrieved or novel item counts not measured"
        )
        return CheckpointSignal(
            name=RETRIEVAL_SATURATION, kind=SignalKind.RISK, value=None, reason=reason
        )
    return CheckpointSignal(
        name=RETRIEVAL_SATURATION,
        kind=SignalKind.RISK,
        value=(retrieved - novel + SATURATION_PRIOR_ITEMS)
        / (retrieved + 2.0 * SATURATION_PRIOR_ITEMS),
        reason=f"{novel} of {retrieved} retrieved items novel",
    )
