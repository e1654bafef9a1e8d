"""Tiny Mooncake-shaped traces for the policy simulator's tests."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from benchmarks.policysim.sessions import RequestContext, SessionTracker, session_contexts
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest


def request(
    chain: Sequence[int], *, at_ms: int = 0, short_by: int = 0, output: int = 200
) -> TraceRequest:
    """A request whose input fills ``chain`` (the last block partly when ``short_by`` > 0: a
    partial block is never kept, and a hit never covers the last token)."""
    return TraceRequest(at_ms, len(chain) * BLOCK_TOKENS - short_by, output, tuple(chain))


def contexts_of(requests: Sequence[TraceRequest]) -> list[RequestContext]:
    return session_contexts(requests, SessionTracker())


def chains(max_requests: int = 30, max_grow: int = 5) -> st.SearchStrategy[list[tuple[int, ...]]]:
    """Prefix-consistent chains: each either extends a prefix of an earlier one or starts anew."""

    @st.composite
    def build(draw: st.DrawFn) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        fresh = 1
        for _ in range(draw(st.integers(1, max_requests))):
            base: tuple[int, ...] = (0,)
            if out and draw(st.booleans()):
                parent = draw(st.sampled_from(out))
                base = parent[: draw(st.integers(1, len(parent)))]
            grow = draw(st.integers(0, max_grow))
            out.append(base + tuple(range(fresh, fresh + grow)))
            fresh += grow
        return out

    return build()
