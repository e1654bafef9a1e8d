"""Bounds, not policies: admit a request exactly when its session will be continued.

They read the future (whether a later request of the trace starts with the same session key),
which nothing live can. Beside them, a real policy's figures read as "how much of what admission
could win here did it win".

``oracle`` knows the future of every request. The ``oracle-later`` bounds know it only for later
turns (requests of a session it has seen before) and admit every session's first request, or
none, by a fixed choice: what no live policy can beat if, as the trace's follow-up table shows,
nothing known when a first request finishes tells whether it will be continued.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import JsonValue

from benchmarks.policysim.admission import NOTHING, Admission
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest


def continued_later(requests: Sequence[TraceRequest], key_blocks: int) -> list[bool]:
    """For each request: does a later request start with the same ``key_blocks`` hash ids?"""
    last: dict[tuple[int, ...], int] = {}
    for index, request in enumerate(requests):
        if len(request.hash_ids) >= key_blocks:
            last[request.hash_ids[:key_blocks]] = index
    return [
        len(request.hash_ids) >= key_blocks and last[request.hash_ids[:key_blocks]] > index
        for index, request in enumerate(requests)
    ]


class ContinuationOracle:
    """Must see the requests in trace order, once each: ``continued`` is indexed by position.

    ``first_turns`` None: every request is admitted iff its session continues. True / False: a
    request whose session has no earlier request (as the session tracker saw it) is admitted /
    refused regardless, and only later turns are admitted iff their session continues.
    """

    def __init__(self, continued: Sequence[bool], *, first_turns: bool | None = None) -> None:
        self._continued = tuple(continued)
        self._next = 0
        self._first_turns = first_turns
        self.name = (
            "oracle"
            if first_turns is None
            else f"oracle-later-first-{'all' if first_turns else 'none'}"
        )

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        if self._next >= len(self._continued):
            raise IndexError(
                f"the oracle knows {len(self._continued)} requests; request {self._next + 1} was "
                "offered"
            )
        admitted = self._continued[self._next]
        self._next += 1
        if self._first_turns is not None and context.observed_reuse == 0:
            admitted = self._first_turns
        if not admitted:
            return NOTHING
        blocks = len(request.hash_ids)
        return Admission(blocks, blocks)

    def stats(self) -> dict[str, JsonValue]:
        return {"reads_the_future": True}
