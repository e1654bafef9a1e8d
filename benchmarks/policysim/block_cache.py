"""What the replay needs from a tier's index: residency, a hit, a write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class BlockCache(Protocol):
    """A bounded set of resident blocks (one block = one trace hash id) with its eviction order.

    ``touch`` records a use (a hit) of a resident block; ``refresh`` only reorders one already
    touched for the same request, so that it stays more recent than the blocks the request has
    just written (a cache that counts uses must not count it twice). ``insert`` offers a block that
    is not resident, evicting by the cache's own order when it is full; it returns whether the block
    was written (False: the cache declined it, as an offline bound's bypass does). A block that was
    written and later turned away inside the cache (TinyLFU's rejection of its window's victim)
    was still written once.
    """

    capacity: int

    def __contains__(self, block: int) -> bool: ...

    def __len__(self) -> int: ...

    def touch(self, block: int) -> None: ...

    def refresh(self, block: int) -> None: ...

    def insert(self, block: int) -> bool: ...


def leading_run(cache: BlockCache, chain: Sequence[int], start: int = 0) -> int:
    """How many blocks of ``chain`` from ``start`` on are resident without a gap."""
    run = 0
    for block in chain[start:]:
        if block not in cache:
            break
        run += 1
    return run


def check_capacity(capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1 (blocks), got {capacity!r}")
    return capacity
