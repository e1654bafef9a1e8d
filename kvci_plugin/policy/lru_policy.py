"""LRUPolicy: keep everything offered, evict the least recently used first.

What vLLM's native CPU offloading and LMCache do by default; kvci runs it as ``ram_policy:
"lru"`` (the keep-everything baseline) and under the worthiness bar (``ram_policy:
"threshold"``). The seed's rule still holds: explicit checkpoints leave last.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

from kvci_plugin.policy.offer import Offer
from kvci_plugin.policy.tier_policy import PolicyStats


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._explicit: set[str] = set()
        self._unread: set[str] = set()
        self._admitted = self._admitted_explicit = self._displaced = self._wasted = 0

    def observe_lookup(self, chain: Sequence[Hashable], now: float) -> int:
        return 0

    def sighted(self, offer: Offer, now: float) -> None:
        return None

    def eviction_order(self, entries: Mapping[str, Any], now: float) -> Iterator[str]:
        explicit = []
        for cid in entries:
            if cid in self._explicit:
                explicit.append(cid)
            else:
                yield cid
        yield from explicit

    def admits(self, offer: Offer, victims: Sequence[str], now: float) -> bool:
        return True

    def admitted(self, checkpoint_id: str, offer: Offer, now: float) -> None:
        self._admitted += 1
        self._unread.add(checkpoint_id)
        if offer.explicit:
            self._admitted_explicit += 1
            self._explicit.add(checkpoint_id)

    def touched(self, checkpoint_ids: Sequence[str], now: float) -> None:
        self._unread.difference_update(checkpoint_ids)

    def dropped(self, checkpoint_id: str, *, evicted: bool) -> None:
        self._explicit.discard(checkpoint_id)
        if evicted:
            self._displaced += 1
            self._wasted += checkpoint_id in self._unread
        self._unread.discard(checkpoint_id)

    def cleared(self) -> None:
        self._explicit.clear()
        self._unread.clear()

    def stats(self) -> PolicyStats:
        return PolicyStats(
            policy=self.name, admitted=self._admitted, admitted_explicit=self._admitted_explicit,
            displaced=self._displaced, refused_under_pressure=0, evicted_before_hit=self._wasted,
            tracked_anchors=0)
