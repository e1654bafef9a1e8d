"""When retention is worth asking for: the run pauses and rebuilding its KV would cost.

An agent whose turn ends on a tool call will be back with the same prefix; while the tool runs,
the tier's policy may evict it. Retention (`kvci.retain`) exempts it for a bounded time. It pays
when a pause is known (a tool call is pending) and the rebuild it saves is costly (the shared
rebuild-cost estimate at or above its half-cost point: about a second of prefill, orders of
magnitude above a RAM load). Nothing known about either: no advice.
"""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.rebuild_cost import RebuildCostModel

_MODEL = RebuildCostModel()


def retain_advice(observation: CheckpointObservation, *, max_retain_s: float,
                  model: RebuildCostModel = _MODEL) -> str | None:
    """The advisory line saying retention is worth asking for, or None when it is not."""
    if not observation.tool_call_pending or max_retain_s <= 0:
        return None
    cost = model.estimate_observation(observation)
    if cost.seconds is None or cost.seconds < model.half_cost_seconds:
        return None
    return (f"retention worth asking for: a tool call is pending and rebuilding this context "
            f"would take about {cost.seconds:.1f} s; send kvci.retain={{\"ttl_s\": <the tool "
            f"call's expected seconds, at most {max_retain_s:g}>}} with requests whose turn ends "
            "on a tool call, and the KV stays in RAM until the session's next request")
