"""rebuild_cost: the strongest economic signal, read from the shared estimator."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.rebuild_cost import RebuildCostEstimate, RebuildCostModel
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

REBUILD_COST = "rebuild_cost"

# Abstentions are the same every time: built once, not per request.
_NOT_MEASURED = CheckpointSignal(
    name=REBUILD_COST,
    kind=SignalKind.OPPORTUNITY,
    value=None,
    reason="neither context size nor wall time measured",
)


class RebuildCostScorer:
    """Value = ``RebuildCostModel.estimate_observation(...).value``; abstains when not known."""

    name = REBUILD_COST
    weight = 0.30

    def __init__(self, model: RebuildCostModel | None = None) -> None:
        self.model = model if model is not None else RebuildCostModel()

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        estimate = self.model.estimate_observation(observation)
        if estimate.seconds is None:
            return _NOT_MEASURED
        return CheckpointSignal(
            name=REBUILD_COST,
            kind=SignalKind.OPPORTUNITY,
            value=estimate.value,
            reason=_reason(estimate),
        )


def _reason(estimate: RebuildCostEstimate) -> str:
    parts = []
    if estimate.tokens is not None:
        parts.append(f"{estimate.tokens} tokens")
    if estimate.tool_calls is not None:
        parts.append(f"{estimate.tool_calls} tool calls")
    if estimate.retrievals is not None:
        parts.append(f"{estimate.retrievals} retrievals")
    if estimate.wall_time_s is not None:
        parts.append(f"{estimate.wall_time_s:.2f} s wall")
    reason = f"rebuild >= {estimate.seconds:.2f} s from {', '.join(parts)}"
    unmeasured = estimate.unmeasured
    return f"{reason}; not measured: {', '.join(unmeasured)}" if unmeasured else reason
