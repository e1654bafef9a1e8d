"""Least-recently-used eviction at block granularity: what vLLM's CPU offloading and LMCache use."""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.policysim.block_cache import check_capacity


class LRUBlockCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        # Oldest first.
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, block: int) -> None:
        self._blocks.move_to_end(block)

    def insert(self, block: int) -> None:
        if block in self._blocks:
            raise ValueError(f"block {block} is already resident: touch it instead")
        if len(self._blocks) >= self.capacity:
            self._blocks.popitem(last=False)
        self._blocks[block] = None
