"""What a live system knows about a request's conversation when the request finishes.

The trace has no session ids, so sessions are inferred from the block chains: a request belongs
to the session keyed by its first ``key_blocks`` hash ids. With ``key_blocks=1`` this is "a
request whose first block equals an earlier request's first block continues it"; in the FAST'25
conversation trace every request starts with the same block (a shared system prompt), so that
rule puts the whole trace in one session, and the default key is the first two blocks.

Within a session, a request that re-sends its predecessor's whole input (all but the
predecessor's last block, which was partial and is now followed by the answer) extends the
context; any other request rewrote it (an edit, a truncation, a different branch). A request's
novel blocks are those its session's previous prompt did not hold: the new message of a turn,
everything after the point where a rewrite diverged, every block of a session's first request.
Everything here is counted from earlier requests only: nothing reads the future.

``threads=True`` (``policy_sim``'s default) infers sessions without a key: a request continues
the earlier thread whose last prompt it extends, and any other request starts its own. Where many
users share a long system prompt (a production trace), keying by the first blocks puts them all in
one session that "rewrites" with every request; threads keep them apart, at the price of never
seeing a rewrite.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.policysim.trace import TraceRequest

DEFAULT_KEY_BLOCKS = 2
# Sessions remembered at once, least recently active forgotten first: a live table is bounded.
DEFAULT_MAX_SESSIONS = 8192
# Rewrites count over the same five-minute window as the cache gate's churn rule.
DEFAULT_REWRITE_WINDOW_S = 300.0


@dataclass(frozen=True, slots=True)
class RequestContext:
    # None when the chain is shorter than the session key.
    session_id: str | None
    # Earlier requests of this session still in the bounded history.
    observed_reuse: int
    # Requests since the session's context was last rewritten (0: created or rewritten now).
    turns_since_change: int
    # Rewrites of the session's context within the rewrite window, this one included.
    context_rewrites: int
    # This request rewrote its session's context.
    rewrote: bool
    # Blocks of this prompt that the session's previous prompt did not hold (all of them in a
    # session's first request); None when the request has no session.
    novel_blocks: int | None


@dataclass(slots=True)
class _Session:
    last_chain: tuple[int, ...]
    requests: int = 1
    turns_since_change: int = 0
    rewrites_ms: deque[int] = field(default_factory=deque)


class SessionTracker:
    def __init__(
        self,
        *,
        key_blocks: int = DEFAULT_KEY_BLOCKS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        rewrite_window_s: float = DEFAULT_REWRITE_WINDOW_S,
        threads: bool = False,
    ) -> None:
        for name, value in (("key_blocks", key_blocks), ("max_sessions", max_sessions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if (
            isinstance(rewrite_window_s, bool)
            or not isinstance(rewrite_window_s, (int, float))
            or not rewrite_window_s > 0
        ):
            raise ValueError(f"rewrite_window_s must be a number > 0, got {rewrite_window_s!r}")
        self.key_blocks = key_blocks
        self.max_sessions = max_sessions
        self.rewrite_window_ms = rewrite_window_s * 1000.0
        self._sessions: OrderedDict[tuple[int, ...], _Session] = OrderedDict()
        self.threads = threads
        # Threads by the id of their last prompt's last full block (chained ids: equal id, equal
        # prefix).
        self._threads: OrderedDict[int, tuple[str, _Session]] = OrderedDict()
        self._thread_count = 0

    def _thread(self, request: TraceRequest) -> RequestContext:
        """``threads``: a request continues the thread whose last prompt it extends; any other
        request starts a thread of its own, so nothing is ever a rewrite."""
        chain = request.hash_ids
        found = None
        for position in range(len(chain) - 1, -1, -1):
            entry = self._threads.get(chain[position])
            if entry is not None and len(entry[1].last_chain) - 2 == position:
                found = self._threads.pop(chain[position])
                break
        if found is None:
            self._thread_count += 1
            session_id, session = f"t{self._thread_count}", _Session(last_chain=chain)
            context = RequestContext(session_id, 0, 0, 0, False, len(chain))
        else:
            session_id, session = found
            session.turns_since_change += 1
            context = RequestContext(
                session_id,
                session.requests,
                session.turns_since_change,
                0,
                False,
                len(chain) - common_prefix(session.last_chain, chain),
            )
            session.requests += 1
            session.last_chain = chain
        if len(chain) >= 2:
            self._threads[chain[-2]] = (session_id, session)
            if len(self._threads) > self.max_sessions:
                self._threads.popitem(last=False)
        return context

    def observe(self, request: TraceRequest) -> RequestContext:
        """The request's context as known when it finishes; then remember the request."""
        chain = request.hash_ids
        if self.threads:
            return self._thread(request)
        if len(chain) < self.key_blocks:
            return RequestContext(None, 0, 0, 0, False, None)
        key = chain[: self.key_blocks]
        session_id = "-".join(map(str, key))
        session = self._sessions.get(key)
        if session is None:
            self._sessions[key] = _Session(last_chain=chain)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return RequestContext(session_id, 0, 0, 0, False, len(chain))
        self._sessions.move_to_end(key)
        rewrote = not extends(session.last_chain, chain)
        if rewrote:
            session.turns_since_change = 0
            session.rewrites_ms.append(request.timestamp_ms)
        else:
            session.turns_since_change += 1
        while (
            session.rewrites_ms
            and session.rewrites_ms[0] <= request.timestamp_ms - self.rewrite_window_ms
        ):
            session.rewrites_ms.popleft()
        context = RequestContext(
            session_id,
            session.requests,
            session.turns_since_change,
            len(session.rewrites_ms),
            rewrote,
            len(chain) - common_prefix(session.last_chain, chain),
        )
        session.requests += 1
        session.last_chain = chain
        return context


def extends(previous: Sequence[int], chain: Sequence[int]) -> bool:
    """``chain`` re-sends every block of ``previous`` but possibly its last (partial) one."""
    full = len(previous) - 1
    return len(chain) >= full and tuple(chain[:full]) == tuple(previous[:full])


def common_prefix(previous: Sequence[int], chain: Sequence[int]) -> int:
    """How many leading blocks ``chain`` shares with ``previous`` (chained ids: a shared id is a
    shared prefix up to it)."""
    shared = 0
    for old, new in zip(previous, chain):
        if old != new:
            break
        shared += 1
    return shared


def session_contexts(
    requests: Sequence[TraceRequest], tracker: SessionTracker
) -> list[RequestContext]:
    return [tracker.observe(request) for request in requests]
