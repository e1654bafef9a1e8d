"""What became of the engine's automatic retentions (#49), for `/metrics`: a hit when the
session's next request loaded the retained checkpoint, an expiry when its TTL ended unused.

The RAM tier's retentions (`tiering.ram.retention`) end the same way for every word — the
session's next request or the TTL — and count those ends for all of them; this follows only the
retentions the engine granted on its own word, keyed by checkpoint, with the chain keys of the
blocks they hold, so that the session's next request can be told apart as a load of one (its RAM
hit covers a retained block) or a return that found nothing retained to load. Scheduler thread.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvci_plugin.connector.request_state import HitTier, RequestState
from kvci_plugin.tiering.types import PageKey


def ram_loaded(st: RequestState, block_size: int) -> Sequence[PageKey]:
    """The chain keys of the blocks kvci loads from its RAM tier for the request (none: it
    loads nothing, or from disk)."""
    if st.keys is None or not st.ext_tokens or st.hit_tier is not HitTier.RAM:
        return ()
    first = st.local_tokens // block_size
    return st.keys[first:(st.local_tokens + st.ext_tokens) // block_size]


@dataclass(frozen=True)
class _Held:
    tenant: str
    session: str | None
    keys: tuple[PageKey, ...]  # the chain keys of the retained blocks (a reference, no copy)
    until: float


class AutoRetentions:
    """The automatic retentions still held, by checkpoint id and by session."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # the RAM tier's retentions' clock (time.monotonic)
        self._held: dict[str, _Held] = {}
        # Per (tenant, session), its retentions' checkpoint ids: a return ends them without a
        # walk of every retention held.
        self._of_session: dict[tuple[str, str], set[str]] = {}
        self._ends: list[tuple[float, str]] = []  # (until, checkpoint id), stale ones skipped

    def __len__(self) -> int:
        return len(self._held)

    def granted(self, checkpoint_id: str, tenant: str, session: str | None,
                keys: Sequence[PageKey], ttl_s: float) -> None:
        until = self.clock() + ttl_s
        self._held[checkpoint_id] = _Held(tenant, session, tuple(keys), until)
        if session is not None:
            self._of_session.setdefault((tenant, session), set()).add(checkpoint_id)
        heapq.heappush(self._ends, (until, checkpoint_id))

    def returned(self, tenant: str, session: str, loaded: Sequence[PageKey]) -> int:
        """The session's next request was scheduled, loading ``loaded`` (the keys of the blocks
        kvci loads from RAM for it, a run of its chain): its retentions end; how many of them
        it loaded. Chain keys name their whole prefix, so a load reaches into a retained chain
        exactly when its first block is one of the chain's."""
        hits = 0
        for cid in self._of_session.pop((tenant, session), ()):
            held = self._held.pop(cid)
            if loaded and loaded[0] in held.keys:
                hits += 1
        return hits

    def expire(self) -> int:
        """The retentions whose TTL ended (their session did not come back): how many. Cheap
        when none has."""
        now, ended = self.clock(), 0
        while self._ends and self._ends[0][0] <= now:
            until, cid = heapq.heappop(self._ends)
            held = self._held.get(cid)
            if held is not None and held.until == until:
                del self._held[cid]
                if held.session is not None:
                    cids = self._of_session[(held.tenant, held.session)]
                    cids.discard(cid)
                    if not cids:
                        del self._of_session[(held.tenant, held.session)]
                ended += 1
        return ended

    def clear(self) -> None:
        """A cache reset ended them all: neither a hit nor an expiry. (A forget's, ended by the
        control surface's thread, are left to end at their TTL and counted as expiries.)"""
        self._held.clear()
        self._of_session.clear()
        self._ends.clear()
