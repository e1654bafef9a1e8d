"""What the tier policy is told about a request that could be kept: an ``Offer``.

Everything in it is known when the request finishes: the worthiness recommendation's score, the
rebuild cost per page from the shared ``RebuildCostEstimate``, whether a client or operator
asked for the checkpoint explicitly, and what the client said of the turn's end
(``tool_call_pending``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvci_plugin.worthiness import CheckpointObservation, CheckpointRecommendation, RebuildCostModel
from kvci_plugin.worthiness.cache_gate import HIT_RATE_FLOOR

# Scores fall into this many equal bands: coarse enough that every band gathers evidence
# quickly, fine enough to separate what the advisor calls poor, middling and strong.
SCORE_BANDS = 4
# The band of a request the advisor had no evidence to score.
UNSCORED_BAND = -1
# Re-sends of a context are told apart up to this: "none", "once", "more than once".
COUNT_CAP = 2


@dataclass(frozen=True, slots=True)
class Offer:
    """A request that finished, as the tier policy weighs it.

    ``anchor`` is the deepest key a continuation re-sends (for an engine, the key of the
    prompt's last full block): a later lookup that holds it re-used this request's context.
    """

    anchor: Hashable
    explicit: bool = False
    score: float | None = None
    rebuild_s_per_page: float | None = None
    # The client's ``tool_call_pending``: True, the turn ends on a tool call and the run will be
    # back; False, it does not; None, not said. Evidence the policy weighs as it learns it, not
    # an order (the order is ``kvci.retain``).
    pending: bool | None = None

    def __post_init__(self) -> None:
        if self.score is not None and not 0.0 <= self.score <= 1.0:
            raise ValueError(f"score must be in [0, 1] or None, not {self.score!r}")
        if self.rebuild_s_per_page is not None and not self.rebuild_s_per_page >= 0.0:
            raise ValueError(
                f"rebuild_s_per_page must be >= 0 or None, not {self.rebuild_s_per_page!r}"
            )

    @property
    def band(self) -> int:
        """The score's band; -1 when the advisor had no evidence to score."""
        if self.score is None:
            return UNSCORED_BAND
        return min(int(self.score * SCORE_BANDS), SCORE_BANDS - 1)


def system_may_offer(rec: CheckpointRecommendation) -> bool:
    """Whether the system trigger offers this request to a value policy at all.

    A value policy replaces the RAM bar, so a score under the bar is still offered (the policy
    weighs it against what it would displace); what blocks at any bar still blocks: a veto, no
    evidence, or the model's self-report standing alone (the rules no bar overrides)."""
    return rec.worth_it or rec.held_back_by_threshold


def default_hit_rate_floor(ram_policy: str) -> float:
    """The cache gate's hit-rate floor when none is configured.

    Under the worthiness bar (``threshold``) the floor is the only check that writes pay back.
    Under ``value`` and ``lru`` it is off: a write is one local copy, the value policy already
    weighs each offer under pressure, and kvci's hit rate counts only what the engine's own
    prefix cache did not serve, so a tier that pays back well still reads low (measured by
    ``benchmarks/replay.py``: at the old floor the cache gate paused most of a conversation slice
    and kvci saved less than with the floor off)."""
    return HIT_RATE_FLOOR if ram_policy == "threshold" else 0.0


def offer_rebuild_s(model: RebuildCostModel, observation: CheckpointObservation) -> float | None:
    """The rebuild seconds an offer is weighed by: the shared estimate of the context's work (its
    tokens and output at the model's prefill rate, its tool calls and retrievals), not its wall
    time. The engine's wall time is this request's own prefill extrapolated to the whole prompt:
    it carries the step's queueing, and when most of the prompt hit it multiplies a few tokens'
    fixed overhead many times over, so it would rank checkpoints by scheduling noise, which no
    simulator of the same policy sees (measured by ``benchmarks/replay.py``)."""
    if observation.wall_time_s is not None:
        observation = observation.model_copy(update={"wall_time_s": None})
    return model.estimate_observation(observation).seconds


def offer_for(
    rec: CheckpointRecommendation | None,
    observation: CheckpointObservation,
    *,
    anchor: Hashable,
    explicit: bool,
    pages: int,
    rebuild: RebuildCostModel,
) -> Offer:
    """The offer of a request the engine is about to keep ``pages`` pages of, as ``observation``
    measured it (its work per page by ``offer_rebuild_s``; unknown when no work is known)."""
    rebuild_s = offer_rebuild_s(rebuild, observation)
    per_page = rebuild_s / pages if rebuild_s is not None and pages > 0 else None
    return Offer(
        anchor=anchor,
        explicit=explicit,
        score=rec.score if rec is not None else None,
        rebuild_s_per_page=per_page,
        pending=observation.tool_call_pending,
    )
