"""Which pages each tier can load now, told to a listener as they come and go.

Fleet routers learn where a prefix lives from events (the connector turns these notices into
vLLM's KV events). The tiers know pages only by their keyed keys; what a listener does with them
is its own business. A page is told stored once, when the tier first can load it, and removed
once, when it no longer can (eviction, a failed copy, a discarded blob, expiry, a reset), however
many checkpoints share it.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from kvci_plugin.tiering.types import PageKey

Tier = Literal["ram", "disk"]
_MAX_EXPIRIES = 65536


class TierListener(Protocol):
    """Told of pages as they become loadable from a tier and as they stop; called with the
    tier manager's lock held, so it must only record (never call back into the tiers)."""

    def pages_stored(self, tier: Tier, keys: Sequence[PageKey]) -> None: ...

    def pages_removed(self, tier: Tier, keys: Sequence[PageKey]) -> None: ...


class LoadablePages:
    """The pages told stored, per tier, so that each change is told once. Bounded by the tiers:
    a page is held here only while its tier holds it."""

    def __init__(self, listener: TierListener) -> None:
        self._listener = listener
        self._lock = threading.Lock()
        self._held: dict[Tier, set[PageKey]] = {"ram": set(), "disk": set()}
        # Retention expiries of durable checkpoints told stored: when the earliest passes, the
        # disk tier is asked to collect them, which tells their pages removed.
        self._expiries: list[float] = []

    def stored(self, tier: Tier, keys: Iterable[PageKey]) -> None:
        with self._lock:
            held = self._held[tier]
            new = [k for k in dict.fromkeys(keys) if k not in held]
            held.update(new)
        if new:
            self._listener.pages_stored(tier, new)

    def removed(self, tier: Tier, keys: Iterable[PageKey]) -> None:
        with self._lock:
            held = self._held[tier]
            gone = [k for k in dict.fromkeys(keys) if k in held]
            held.difference_update(gone)
        if gone:
            self._listener.pages_removed(tier, gone)

    def cleared(self, tier: Tier) -> None:
        with self._lock:
            gone, self._held[tier] = list(self._held[tier]), set()
            if tier == "disk":
                self._expiries = []
        if gone:
            self._listener.pages_removed(tier, gone)

    def held(self, tier: Tier) -> frozenset[PageKey]:
        with self._lock:
            return frozenset(self._held[tier])

    def expires(self, when: float) -> None:
        with self._lock:
            heapq.heappush(self._expiries, when)
            if len(self._expiries) > _MAX_EXPIRIES:  # keep the earliest: those come due first
                self._expiries = heapq.nsmallest(_MAX_EXPIRIES // 2, self._expiries)

    def expiry_due(self, now: float) -> bool:
        """Whether a durable checkpoint told stored has passed its retention; forgets those."""
        due = False
        with self._lock:
            while self._expiries and self._expiries[0] <= now:
                heapq.heappop(self._expiries)
                due = True
        return due
