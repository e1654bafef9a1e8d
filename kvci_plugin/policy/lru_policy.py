"""LRUPolicy: keep everything offered, evict the least recently used first.

What vLLM's native CPU offloading and LMCache do by default; kvci runs it as ``ram_policy:
"lru"`` (the keep-everything baseline) and under the worthiness bar (``ram_policy:
"threshold"``). Explicit checkpoints still leave last.

A checkpoint is used when its whole context is: a lookup re-sends its anchor, or a load reads
it whole (the index touches only those). A hit on a shared prefix alone (a system prompt many
users send) leaves the holders' tails where they were, as a block-level LRU leaves the blocks it
did not read: refreshing every holder kept their tails and lost a good part of an LRU's hits on
a trace of many users behind shared prompts (``benchmarks/policy_sim``, Mooncake's mixed trace).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence
from typing import Any

from kvci_plugin.ops.quiet import IdsByKey, untracked
from kvci_plugin.policy.offer import Offer
from kvci_plugin.policy.reuse_hazard import HazardCounts
from kvci_plugin.policy.tier_policy import PolicyStats


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        # Held checkpoints, least recently used first; by anchor, those a lookup refreshes, in
        # the order they were admitted (a set's order follows the hash of random ids, and made
        # a lookup's touches differ run to run). Ids only: maps no full collection walks
        # (``ops.quiet``).
        self._order: OrderedDict[str, None] = untracked(OrderedDict())
        self._by_anchor = IdsByKey()
        self._anchor_of: dict[str, Hashable] = {}
        self._explicit: set[str] = untracked(set())
        self._unread: set[str] = untracked(set())
        self._admitted = self._admitted_explicit = self._displaced = self._wasted = 0

    def observe_lookup(self, chain: Sequence[Hashable], now: float) -> None:
        for held in self._by_anchor.found_in(chain):
            self.touched(held, now)

    def sighted(self, offer: Offer, now: float) -> None:
        return None

    def eviction_order(self, entries: Mapping[str, Any], now: float) -> Iterator[str]:
        explicit = []
        for cid in self._order:
            if cid in self._explicit:
                explicit.append(cid)
            else:
                yield cid
        yield from explicit
        # Checkpoints the policy was never told about (none when the index drives it) go last.
        for cid in entries:
            if cid not in self._order:
                yield cid

    def admits(self, offer: Offer, victims: Sequence[str], now: float,
               displaced: Collection[str] | None = None) -> bool:
        return True

    def admitted(self, checkpoint_id: str, offer: Offer, now: float) -> None:
        self._admitted += 1
        self._unread.add(checkpoint_id)
        self._order[checkpoint_id] = None
        self._anchor_of[checkpoint_id] = offer.anchor
        self._by_anchor.add(offer.anchor, checkpoint_id)
        if offer.explicit:
            self._admitted_explicit += 1
            self._explicit.add(checkpoint_id)

    def resent_prefix(self, chain: Sequence[Hashable]) -> tuple[int, Offer] | None:
        return None  # the baseline keeps what it is offered and nothing more

    def touched(self, checkpoint_ids: Sequence[str], now: float) -> None:
        self._unread.difference_update(checkpoint_ids)
        for cid in checkpoint_ids:
            if cid in self._order:
                self._order.move_to_end(cid)

    def dropped(self, checkpoint_id: str, *, evicted: bool) -> None:
        self._order.pop(checkpoint_id, None)
        anchor = self._anchor_of.pop(checkpoint_id, None)
        if anchor is not None:
            self._by_anchor.discard(anchor, checkpoint_id)
        self._explicit.discard(checkpoint_id)
        if evicted:
            self._displaced += 1
            self._wasted += checkpoint_id in self._unread
        self._unread.discard(checkpoint_id)

    def trimmed(self, checkpoint_id: str, anchor: Hashable) -> None:
        old = self._anchor_of.get(checkpoint_id)
        if old is None:
            return
        self._by_anchor.discard(old, checkpoint_id)
        self._anchor_of[checkpoint_id] = anchor
        self._by_anchor.add(anchor, checkpoint_id)

    def retained(self, checkpoint_id: str) -> None:
        return None  # a retention's pins hold it; recency is all this policy weighs

    def cleared(self) -> None:
        self._order.clear()
        self._by_anchor.clear()
        self._anchor_of.clear()
        self._explicit.clear()
        self._unread.clear()

    def learned(self, now: float) -> HazardCounts | None:
        return None  # recency alone: nothing to carry over a restart

    def stats(self) -> PolicyStats:
        return PolicyStats(
            policy=self.name, admitted=self._admitted, admitted_explicit=self._admitted_explicit,
            displaced=self._displaced, refused_under_pressure=0, evicted_before_hit=self._wasted,
            tracked_anchors=0)
