"""A held checkpoint is nothing the garbage collector walks: its record and its policy anchor hold
only leaves (strings, numbers, bytes, numpy arrays), so the young collections on vLLM's scheduler
thread do not grow with the tier (issue #51: at 10^6 pages they walked every record made since
the last and paused for milliseconds); nor do the maps that hold them, so neither does a full
collection (which walked every entry of the maps by checkpoint, page and anchor: milliseconds at
10^6 pages)."""

from __future__ import annotations

import gc
import sys

import pytest

from kvci_plugin.policy import Offer
from kvci_plugin.policy.ram_policy import ram_policy_for
from kvci_plugin.policy.value_policy import ValuePolicy
from kvci_plugin.tiering.ram.index import RAMIndex

_CONTAINERS = (dict, list, set, frozenset, tuple)

CHECKPOINTS = 2000


def _key(i: int, page: int) -> bytes:
    return (i << 32 | page).to_bytes(16, "big")


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("policy", ["value", "lru"])
def test_holding_thousands_of_checkpoints_adds_almost_nothing_for_the_collector(
        policy: str) -> None:
    index = RAMIndex(num_slots=4 * CHECKPOINTS, slot_bytes=64, max_entries=CHECKPOINTS,
                     policy=ram_policy_for(policy).tier_policy())
    before = _tracked()
    for i in range(CHECKPOINTS):
        keys = [_key(i, p) for p in range(4)]
        index.reserve(f"c{i}", "t", keys, {"trigger": "system"}, offer=Offer(anchor=keys[-1]))
        index.commit(f"c{i}")
    assert index.stats().entries == CHECKPOINTS
    # Each checkpoint was a record and an anchor the collector walked: 2 objects a checkpoint.
    assert _tracked() - before < CHECKPOINTS // 20


def test_an_evicted_checkpoints_record_and_anchor_are_freed() -> None:
    """Untracked, they are still freed as their last reference goes (the memory blocks Python
    has allocated do not grow with the checkpoints that came and went)."""
    index = RAMIndex(num_slots=8, slot_bytes=64, max_entries=2,
                     policy=ValuePolicy(max_ghosts=0))

    def churn(first: int) -> None:
        for i in range(first, first + CHECKPOINTS):  # each evicts the oldest: two stay held
            keys = [_key(i, p) for p in range(4)]
            offer = Offer(anchor=keys[-1], explicit=True)
            index.sight(offer)  # as the connector does, before it keeps: a ghost is forgotten
            index.reserve(f"c{i}", "t", keys, None, offer=offer)
            index.commit(f"c{i}")

    churn(0)  # every structure at its working size
    gc.collect()
    before = sys.getallocatedblocks()
    churn(CHECKPOINTS)
    gc.collect()
    assert index.stats().entries == 2 and index.stats().evictions == 2 * CHECKPOINTS - 2
    # A record, its slots and its anchor leaked a checkpoint would be thousands of blocks.
    assert sys.getallocatedblocks() - before < CHECKPOINTS // 4


def _walked(root: object) -> int:
    """The references a full collection follows from the objects it walks (tracked, not frozen)
    reachable from ``root`` (through kvci's objects and plain containers, walked or not)."""
    walks = {id(o) for o in gc.get_objects()}  # the frozen heap is left out
    seen: set[int] = set()
    stack, walked = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        refs = gc.get_referents(obj)
        if id(obj) in walks:
            walked += len(refs)
        stack.extend(r for r in refs if isinstance(r, _CONTAINERS)
                     or type(r).__module__.startswith("kvci_plugin"))
    return walked


@pytest.mark.parametrize("policy", ["value", "lru"])
def test_a_full_collection_walks_no_more_for_ten_times_the_checkpoints(policy: str) -> None:
    """As in the engine: vLLM's EngineCore freezes its startup heap (``freeze_gc_heap``) after
    the scheduler, kvci's connector and its tier among it, was built; what serving adds is what
    a full collection walks."""
    def fill(index: RAMIndex, n: int) -> None:
        for i in range(n):
            keys = [_key(i, p) for p in range(4)]
            index.sight(Offer(anchor=keys[-1]))
            index.reserve(f"c{i}", "t", keys, {"trigger": "system"},
                          offer=Offer(anchor=keys[-1]))
            index.commit(f"c{i}")
            if i % 3 == 0:  # re-sent: the anchor moves to another class
                index.observe_lookup(keys)

    small, large = (RAMIndex(num_slots=4 * CHECKPOINTS, slot_bytes=64, max_entries=CHECKPOINTS,
                             policy=ram_policy_for(policy).tier_policy()) for _ in range(2))
    gc.collect()
    gc.freeze()
    try:
        fill(small, CHECKPOINTS // 10)
        fill(large, CHECKPOINTS)
        gc.collect()  # a full collection stops tracking the maps that hold only atoms
        # The maps by page and anchor, and the value policy's by class, were walked whole:
        # ~10 references a checkpoint.
        assert _walked(large) - _walked(small) < CHECKPOINTS // 20
    finally:
        gc.unfreeze()
