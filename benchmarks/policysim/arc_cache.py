"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) at block granularity.

vLLM's CPU offloading offers ARC beside LRU. T1 holds blocks seen once recently, T2 blocks seen
at least twice; the ghost lists B1/B2 remember what each evicted and steer the target size ``p``
of T1 towards whichever list's ghosts are being asked for again.
"""

from __future__ import annotations

from collections import OrderedDict

from benchmarks.policysim.block_cache import check_capacity


class ARCBlockCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self.target_t1 = 0.0
        # Each list oldest first.
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def touch(self, block: int) -> None:
        if block in self.t1:
            del self.t1[block]
            self.t2[block] = None
        else:
            self.t2.move_to_end(block)

    def refresh(self, block: int) -> None:
        # Only its recency moves, in the list it is in: touched for this request it went to T2,
        # but this request's own writes may have evicted it and written it again, into T1.
        (self.t2 if block in self.t2 else self.t1).move_to_end(block)

    def insert(self, block: int) -> bool:
        if block in self:
            raise ValueError(f"block {block} is already resident: touch it instead")
        c = self.capacity
        if block in self.b1:
            self.target_t1 = min(float(c), self.target_t1 + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(in_b2=False)
            del self.b1[block]
            self.t2[block] = None
            return True
        if block in self.b2:
            self.target_t1 = max(0.0, self.target_t1 - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(in_b2=True)
            del self.b2[block]
            self.t2[block] = None
            return True
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                self._replace(in_b2=False)
            else:
                self.t1.popitem(last=False)
        elif total >= c:
            if total >= 2 * c:
                self.b2.popitem(last=False)
            self._replace(in_b2=False)
        self.t1[block] = None
        return True

    def _replace(self, *, in_b2: bool) -> None:
        """Evict one resident block into its ghost list, when the cache is full."""
        if len(self) < self.capacity:
            return
        t1 = len(self.t1)
        if self.t1 and (not self.t2 or t1 > self.target_t1 or (in_b2 and t1 == self.target_t1)):
            block, _ = self.t1.popitem(last=False)
            self.b1[block] = None
        else:
            block, _ = self.t2.popitem(last=False)
            self.b2[block] = None
