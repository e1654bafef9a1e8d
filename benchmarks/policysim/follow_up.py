"""How often a request is followed up (its session sends another request later), against what is
known when it finishes.

Descriptive, not a policy: it reads the whole trace. It shows why admission cannot tell a
session's first request that will be continued from one that will not: the rate is flat across
the first request's input and output lengths, and only later turns, whose rate rises with the
turn count, carry a signal. Sessions and turn counts are the ones the simulator infers
(``benchmarks/policysim/sessions.py``); whether a session continues is the oracle's
``continued_later``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest

# Bucket lower bounds (each bucket runs to the next bound, the last is open), powers of two.
INPUT_BLOCK_BOUNDS = (1, 3, 5, 9, 17, 33, 65)
OUTPUT_TOKEN_BOUNDS = (0, 128, 256, 512, 1024)
# Turn 1 is a session's first request; turns from the last bound on are counted together.
TURN_BOUNDS = (1, 2, 3, 4, 5, 6)

T = TypeVar("T")

_FROZEN = ConfigDict(frozen=True, extra="forbid")
NonNegativeInt = Annotated[int, Field(ge=0)]


class FollowUpRate(BaseModel):
    model_config = _FROZEN

    # The bucket holds values from ``low`` to ``high`` inclusive; ``high`` None: no upper bound.
    low: NonNegativeInt
    high: NonNegativeInt | None
    requests: NonNegativeInt
    followed_up: NonNegativeInt
    # followed_up / requests; None when the bucket is empty.
    rate: float | None


class FollowUpTable(BaseModel):
    model_config = _FROZEN

    # Sessions' first requests, by input length in blocks and by output length in tokens.
    first_turns_by_input_blocks: tuple[FollowUpRate, ...]
    first_turns_by_output_tokens: tuple[FollowUpRate, ...]
    # Every request of a session, by its turn (1: the session's first request).
    by_turn: tuple[FollowUpRate, ...]


def follow_up_table(
    requests: Sequence[TraceRequest], contexts: Sequence[RequestContext], continued: Sequence[bool]
) -> FollowUpTable:
    """``continued[i]``: a later request continues request i's session (``continued_later``)."""
    if not len(requests) == len(contexts) == len(continued):
        raise ValueError(
            f"{len(requests)} requests, {len(contexts)} contexts, {len(continued)} continuations"
        )
    # (request, turn, followed up) for every request that has a session.
    turns = [
        (request, context.observed_reuse + 1, followed)
        for request, context, followed in zip(requests, contexts, continued)
        if context.session_id is not None
    ]
    first = [(request, followed) for request, turn, followed in turns if turn == 1]
    return FollowUpTable(
        first_turns_by_input_blocks=_rates(
            first, INPUT_BLOCK_BOUNDS, lambda request: len(request.hash_ids)
        ),
        first_turns_by_output_tokens=_rates(
            first, OUTPUT_TOKEN_BOUNDS, lambda request: request.output_length
        ),
        by_turn=_rates(
            [(turn, followed) for _, turn, followed in turns], TURN_BOUNDS, lambda turn: turn
        ),
    )


def _rates(
    rows: Sequence[tuple[T, bool]], bounds: Sequence[int], value: Callable[[T], int]
) -> tuple[FollowUpRate, ...]:
    highs: list[int | None] = [bound - 1 for bound in bounds[1:]]
    highs.append(None)
    rates = []
    for low, high in zip(bounds, highs):
        inside = [
            followed
            for item, followed in rows
            if low <= value(item) and (high is None or value(item) <= high)
        ]
        rates.append(
            FollowUpRate(
                low=low,
                high=high,
                requests=len(inside),
                followed_up=sum(inside),
                rate=sum(inside) / len(inside) if inside else None,
            )
        )
    return tuple(rates)
