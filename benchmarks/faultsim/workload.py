"""The fault replay's slice of the trace: the multi-turn threads it sends (see
``benchmarks/fault_replay.py``), and the bytes of one engine block."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks.policysim.sessions import SessionTracker, session_contexts
from benchmarks.policysim.trace import TraceRequest
from benchmarks.replaysim.workload import ENGINE_BLOCK_TOKENS


def select_threads(
    requests: Sequence[TraceRequest], sessions_from: int, max_blocks: int
) -> list[TraceRequest]:
    """The multi-turn threads that start within the first ``sessions_from`` requests, every turn
    of theirs in ``requests``, in trace order; a thread with a request over ``max_blocks`` blocks
    is left out whole."""
    contexts = session_contexts(requests, SessionTracker(threads=True, max_sessions=1 << 20))
    first: dict[str, int] = {}
    turns: Counter[str] = Counter()
    too_long: set[str] = set()
    for i, (request, context) in enumerate(zip(requests, contexts)):
        sid = context.session_id or f"#{i}"
        first.setdefault(sid, i)
        turns[sid] += 1
        if len(request.hash_ids) > max_blocks:
            too_long.add(sid)
    return [
        r
        for i, (r, c) in enumerate(zip(requests, contexts))
        if (sid := c.session_id or f"#{i}") not in too_long
        and turns[sid] >= 2
        and first[sid] < sessions_from
    ]


def page_bytes(spec: Any) -> int:
    """Bytes of one engine block across every layer: one kvci RAM slot."""
    return spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * 4 * ENGINE_BLOCK_TOKENS
