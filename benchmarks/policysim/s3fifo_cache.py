"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23) at block
granularity.

The rules, as the paper's Algorithm 1 and its reference implementation (libCacheSim's
``S3FIFOv0``, the version the paper measured) state them:

- a small FIFO S of 10 % of the capacity takes every new block; a main FIFO M the rest; a ghost
  FIFO G remembers the ids (no data) of as many blocks as M holds, evicted from S;
- a hit only counts: a 2-bit frequency, capped at 3; nothing moves (lazy promotion);
- a block that is in G when it is written again enters M directly;
- eviction takes from S while S holds at least its 10 %, else from M;
- S's oldest block moves to M if it was hit at least ``move_to_main_hits`` times while in S (2,
  libCacheSim's default: "accessed more than once"), else leaves for G (quick demotion);
- M's oldest block is reinserted at M's head with its frequency decreased by one while it is
  above zero (a 2-bit CLOCK), else evicted.

A move from S to M and a reinsertion are not writes: the block stays in the same memory.
"""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.policysim.block_cache import check_capacity

SMALL_FRACTION = 0.10
MAX_FREQUENCY = 3
DEFAULT_MOVE_TO_MAIN_HITS = 2


class S3FIFOBlockCache:
    def __init__(
        self, capacity: int, *, move_to_main_hits: int = DEFAULT_MOVE_TO_MAIN_HITS
    ) -> None:
        self.capacity = check_capacity(capacity)
        self.small_target = max(1, int(SMALL_FRACTION * capacity))
        self.move_to_main_hits = move_to_main_hits
        # Each queue oldest first; S and M map a block to its frequency.
        self.small: OrderedDict[int, int] = OrderedDict()
        self.main: OrderedDict[int, int] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.small or block in self.main

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def touch(self, block: int) -> None:
        queue = self.small if block in self.small else self.main
        queue[block] = min(queue[block] + 1, MAX_FREQUENCY)

    def refresh(self, block: int) -> None:
        """FIFO order does not follow use."""

    def insert(self, block: int) -> bool:
        if block in self:
            raise ValueError(f"block {block} is already resident: touch it instead")
        while len(self) >= self.capacity:
            self._evict()
        if block in self.ghost:
            del self.ghost[block]
            self.main[block] = 0
        else:
            self.small[block] = 0
        return True

    def _evict(self) -> None:
        if self.small and (len(self.small) >= self.small_target or not self.main):
            self._evict_small()
        else:
            self._evict_main()

    def _evict_small(self) -> None:
        while self.small:
            block, frequency = self.small.popitem(last=False)
            if frequency >= self.move_to_main_hits:
                # Algorithm 1 keeps the counter through the move.
                self.main[block] = frequency
                if len(self.main) > self.capacity - self.small_target:
                    self._evict_main()
                    return
            else:
                self.ghost[block] = None
                while len(self.ghost) > max(1, self.capacity - self.small_target):
                    self.ghost.popitem(last=False)
                return

    def _evict_main(self) -> None:
        while self.main:
            block, frequency = self.main.popitem(last=False)
            if frequency == 0:
                return
            self.main[block] = frequency - 1
