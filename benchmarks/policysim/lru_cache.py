"""Least-recently-used eviction at block granularity: what vLLM's CPU offloading and LMCache use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from benchmarks.policysim.block_cache import check_capacity


class LRUBlockCache:
    """``on_evict`` is told every evicted block (a policy that learns from evictions listens)."""

    def __init__(self, capacity: int, *, on_evict: Callable[[int], None] | None = None) -> None:
        self.capacity = check_capacity(capacity)
        self._on_evict = on_evict
        # Oldest first.
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, block: int) -> None:
        self._blocks.move_to_end(block)

    refresh = touch

    def insert(self, block: int) -> bool:
        if block in self._blocks:
            raise ValueError(f"block {block} is already resident: touch it instead")
        if len(self._blocks) >= self.capacity:
            evicted, _ = self._blocks.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(evicted)
        self._blocks[block] = None
        return True
