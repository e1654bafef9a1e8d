"""A bound, not a policy: admit a request exactly when its session will be continued.

It reads the future (whether a later request of the trace starts with the same session key),
which nothing live can. Beside it, a real policy's figures read as "how much of what admission
could win here did it win".
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
    """Must see the requests in trace order, once each: ``continued`` is indexed by position."""

    name = "oracle"

    def __init__(self, continued: Sequence[bool]) -> None:
        self._continued = tuple(continued)
        self._next = 0

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        if self._next >= len(self._continued):
            raise IndexError(f"the oracle knows {len(self._continued)} requests; request {self._next + 1} was offered")
        continued = self._continued[self._next]
        self._next += 1
        if not continued:
            return NOTHING
        blocks = len(request.hash_ids)
        return Admission(blocks, blocks)

    def stats(self) -> dict[str, JsonValue]:
        return {"reads_the_future": True}
