"""W-TinyLFU (Einziger, Friedman & Manes, "TinyLFU: A Highly Efficient Cache Admission Policy",
ACM ToS 2017; the design Caffeine ships) at block granularity.

- A window LRU of 1 % of the capacity takes every new block: a burst gets its hits there.
- The main cache, the rest, is a segmented LRU: blocks enter its probation segment; a hit in
  probation promotes to the protected segment (80 % of the main cache), whose least recently used
  block falls back to probation's most recent end when it is over its share.
- Admission: the window's least recently used block is the candidate for the main cache. While
  the main cache has room it enters; else it displaces the main cache's victim (probation's least
  recently used, or protected's when probation is empty) only if its estimated frequency is
  higher, and is dropped otherwise (ties keep the resident).
- The frequency estimate is the count-min sketch behind a doorkeeper, aged by halving
  (``frequency_sketch.py``); every use records one occurrence: a hit (``touch``) and a miss's write
  (``insert``), never ``refresh``, which only reorders a block already touched for this request.
- Caffeine's random admission of a few rejected candidates (a defence against hash flooding) is
  left out: a replay has no adversary.

Writes: every inserted block enters the window, so ``insert`` always writes. A candidate dropped by
the admission test was written once when it entered the window and leaves without a second write;
moving between the window and the main cache's segments is not a write (the same memory).
"""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.policysim.block_cache import check_capacity
from benchmarks.policysim.frequency_sketch import FrequencySketch

WINDOW_FRACTION = 0.01
PROTECTED_FRACTION = 0.80


class WTinyLFUBlockCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self.window_capacity = max(1, int(WINDOW_FRACTION * capacity))
        self.main_capacity = capacity - self.window_capacity
        self.protected_capacity = int(PROTECTED_FRACTION * self.main_capacity)
        self.sketch = FrequencySketch(capacity)
        # Each segment oldest first.
        self.window: OrderedDict[int, None] = OrderedDict()
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.rejected = 0

    def __contains__(self, block: int) -> bool:
        return block in self.window or block in self.probation or block in self.protected

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    def touch(self, block: int) -> None:
        self.sketch.record(block)
        if block in self.probation:
            del self.probation[block]
            self.protected[block] = None
            if len(self.protected) > self.protected_capacity:
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None
        else:
            self.refresh(block)

    def refresh(self, block: int) -> None:
        for segment in (self.window, self.probation, self.protected):
            if block in segment:
                segment.move_to_end(block)
                return

    def insert(self, block: int) -> bool:
        if block in self:
            raise ValueError(f"block {block} is already resident: touch it instead")
        self.sketch.record(block)
        self.window[block] = None
        if len(self.window) > self.window_capacity:
            candidate, _ = self.window.popitem(last=False)
            self._admit(candidate)
        return True

    def _admit(self, candidate: int) -> None:
        if len(self.probation) + len(self.protected) < self.main_capacity:
            self.probation[candidate] = None
            return
        victims = self.probation if self.probation else self.protected
        if not victims:  # no main cache at all (capacity 1): the window is the cache
            self.rejected += 1
            return
        victim = next(iter(victims))
        if self.sketch.estimate(candidate) > self.sketch.estimate(victim):
            del victims[victim]
            self.probation[candidate] = None
        else:
            self.rejected += 1
