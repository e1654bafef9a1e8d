"""The one rebuild-cost estimator: what it would take to rebuild a context's KV cache.

The ``rebuild_cost`` scorer, the tiers and the eviction order all read this estimate, so
"expensive to rebuild" means the same thing on both sides of the cache.

Each measured input gives a lower bound on the seconds a rebuild takes: the wall time that
assembled the context, and the work it took (re-prefilling the tokens plus re-running the tool
calls and retrievals). The estimate is the larger bound, so the two never double-count the same
time. ``None`` means "not measured" and ``0`` "measured zero": the estimate is ``known`` only when
the context size or the wall time was measured, because the prefill is the part of a rebuild no
run avoids; without either, the consumer abstains instead of reading the context as free.
"""

from __future__ import annotations

import math
from typing import Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from kvci_plugin.worthiness.observation import CheckpointObservation

# Prefill throughput of a 7-8B model on one current datacenter GPU, conservatively: the engine
# passes the measured prefill time as wall time, which corrects this wherever it is off.
PREFILL_TOKENS_PER_SECOND = 8192.0
# A remote tool round trip and a vector/graph query, typical orders of magnitude.
TOOL_CALL_SECONDS = 1.0
RETRIEVAL_SECONDS = 0.5
# One second of rebuild maps to 0.5: about the time-to-first-token delay a user notices, and
# orders of magnitude above a RAM-tier load (~20 ms for 1 GiB at ~50 GB/s). With the default
# throughput it puts the 0.5 point at an 8192-token context.
HALF_COST_SECONDS = 1.0


class RebuildCostEstimate(NamedTuple):
    """The inputs as measured, the rebuild time they bound, and that time mapped to [0, 1].

    Immutable; a NamedTuple rather than a frozen dataclass because it is built on the
    per-request path, where a frozen dataclass costs several times more to construct.
    """

    tokens: int | None
    tool_calls: int | None
    retrievals: int | None
    wall_time_s: float | None
    # Lower bound on the seconds a rebuild takes; None when not known.
    seconds: float | None
    # seconds / (seconds + half_cost_seconds): monotone, 0 for a free rebuild, -> 1 for costly ones.
    value: float | None

    @property
    def known(self) -> bool:
        return self.seconds is not None

    @property
    def unmeasured(self) -> tuple[str, ...]:
        inputs = (
            ("tokens", self.tokens),
            ("tool_calls", self.tool_calls),
            ("retrievals", self.retrievals),
            ("wall_time_s", self.wall_time_s),
        )
        return tuple(name for name, value in inputs if value is None)


class RebuildCostModel(BaseModel):
    """The constants of the estimate; one instance is shared by everything that reads it."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    prefill_tokens_per_second: Annotated[float, Field(gt=0.0)] = PREFILL_TOKENS_PER_SECOND
    tool_call_seconds: Annotated[float, Field(ge=0.0)] = TOOL_CALL_SECONDS
    retrieval_seconds: Annotated[float, Field(ge=0.0)] = RETRIEVAL_SECONDS
    half_cost_seconds: Annotated[float, Field(gt=0.0)] = HALF_COST_SECONDS

    def estimate(
        self,
        *,
        tokens: int | None = None,
        tool_calls: int | None = None,
        retrievals: int | None = None,
        wall_time_s: float | None = None,
    ) -> RebuildCostEstimate:
        """The estimate for raw inputs (each checked: counts >= 0, wall time finite and >= 0)."""
        _check_count("tokens", tokens)
        _check_count("tool_calls", tool_calls)
        _check_count("retrievals", retrievals)
        if wall_time_s is not None:
            if isinstance(wall_time_s, bool) or not isinstance(wall_time_s, (int, float)):
                raise TypeError(f"wall_time_s must be a number, got {type(wall_time_s).__name__}")
            if not (math.isfinite(wall_time_s) and wall_time_s >= 0.0):
                raise ValueError(f"wall_time_s must be finite and >= 0, got {wall_time_s!r}")
        return self._estimate(tokens, tool_calls, retrievals, wall_time_s)

    def estimate_observation(self, observation: CheckpointObservation) -> RebuildCostEstimate:
        """The estimate for an observation; its KV covers the context and any output tokens."""
        tokens = observation.context_tokens
        if tokens is not None and observation.output_tokens is not None:
            tokens += observation.output_tokens
        # The observation's fields are validated already: skip the checks on the hot path.
        return self._estimate(
            tokens, observation.tool_calls, observation.retrievals, observation.wall_time_s
        )

    def _estimate(
        self,
        tokens: int | None,
        tool_calls: int | None,
        retrievals: int | None,
        wall_time_s: float | None,
    ) -> RebuildCostEstimate:
        if tokens is None and wall_time_s is None:
            return RebuildCostEstimate(tokens, tool_calls, retrievals, wall_time_s, None, None)
        work = 0.0
        if tokens is not None:
            work += tokens / self.prefill_tokens_per_second
        if tool_calls is not None:
            work += tool_calls * self.tool_call_seconds
        if retrievals is not None:
            work += retrievals * self.retrieval_seconds
        seconds = max(work, wall_time_s or 0.0)
        value = seconds / (seconds + self.half_cost_seconds)
        return RebuildCostEstimate(tokens, tool_calls, retrievals, wall_time_s, seconds, value)


def _check_count(field: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{field} must be >= 0, got {value}")
