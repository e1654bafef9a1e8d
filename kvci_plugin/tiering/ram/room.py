"""The RAM tier's records, and how room is made for a new checkpoint: fair shares first.

Room is made under pressure only: while pages are free, any tenant may hold more than its
share (the tier is work-conserving). When a reservation needs room, it comes first from the
**pools** over their fair share — the tier's pages split evenly among the pools holding pages
and the one asking — explicit and retained-free checkpoints of theirs included, whatever the
policy would have kept: an explicit checkpoint is no shield against another tenant's work.
A pool is a verified tenant, or every declared (unverified) tenant together: renaming a declared
tenant buys no second share. A pool within its share then takes room in the policy's own order
(the policy may still refuse to displace what it values more); a pool past its share takes it
from its own checkpoints first, and from pools within their share only what its own cannot free
(a checkpoint larger than its share, or its own pages pinned), in the policy's order — so a
flood of one tenant's keeps churns that tenant's own checkpoints, not the others'.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvci_plugin.tiering.types import DoesNotFitError, PageKey

DECLARED_POOL = "\0declared"
"""The pool of every declared (unverified) tenant: no valid tenant name has a NUL in it."""


@dataclass
class Page:
    slot: int
    tenant: str
    pool: str
    # Checkpoints referencing the page: its reference count is len(holders).
    holders: set[str] = field(default_factory=set)
    pins: int = 0
    ready: bool = False
    # Its tenant was forgotten while a load or a persist still pinned it: never found, loaded
    # or held again, and freed at the last ``unpin``.
    erased: bool = False
    # The pending checkpoint whose reservation copies the bytes in; None once ready, or when that
    # reservation was aborted while other checkpoints still reference the page (the next
    # reservation that names the page then copies it).
    writer: str | None = None


@dataclass
class Entry:
    tenant: str
    pool: str
    keys: tuple[PageKey, ...]
    distinct: tuple[PageKey, ...]
    created: float
    last_used: float
    # Orders touches made in the same instant; the OrderedDict holds the LRU order itself.
    use_seq: int
    pending: bool
    meta: dict[str, Any]


@dataclass
class Over:
    """How far a reservation would take each bound past its limit (> 0: room is needed)."""

    entries: int
    pages: int
    quota: int  # the tenant's tenant_quota_bytes, in pages

    def met(self) -> bool:
        return self.entries <= 0 and self.pages <= 0 and self.quota <= 0


@dataclass(frozen=True)
class Room:
    """The checkpoints to evict: ``fair`` (taken from pools over their share, past any veto of
    the policy) and ``ranked`` (in the policy's order; the policy may refuse them)."""

    fair: list[str]
    ranked: list[str]

    @property
    def victims(self) -> list[str]:
        return self.fair + self.ranked


@dataclass
class RoomPlanner:
    """One reservation's room: ``order`` is the policy's eviction order of ``entries``."""

    entries: Mapping[str, Entry]
    pages: Mapping[PageKey, Page]
    pool_pages: Counter[str]
    capacity: int
    evictable: Callable[[Entry], bool]

    def share(self, pool: str) -> int:
        """The pages a pool's fair share is now: the tier split among the pools holding pages
        and ``pool``."""
        return max(1, self.capacity // len(self._active(pool)))

    def _active(self, pool: str) -> set[str]:
        return {p for p, n in self.pool_pages.items() if n > 0} | {pool}

    def plan(self, tenant: str, pool: str, keep: set[PageKey], n_new: int, over: Over,
             order: Iterable[str]) -> Room:
        if over.met():
            return Room([], [])
        share = self.share(pool)
        excess = {p: n - share for p, n in self.pool_pages.items() if p != pool and n > share}
        # Alone, a pool's share is the whole tier: the policy's order is all there is.
        asker_over = (len(self._active(pool)) > 1
                      and self.pool_pages[pool] + n_new > share)
        freed: Counter[str] = Counter()
        released: Counter[PageKey] = Counter()
        if not excess and not asker_over:  # the common case: the policy's order, taken lazily
            ranked = [cid for cid in self._taking(order, tenant, keep, over, released, freed)]
            return self._checked(Room([], ranked), over)
        candidates = list(order)
        # Other pools' checkpoints past their share, until each is back within it.
        fair = list(self._taking(
            (c for c in candidates if excess.get(self.entries[c].pool, 0)
             > freed[self.entries[c].pool]), tenant, keep, over, released, freed))
        taken = set(fair)
        ranked = []
        if asker_over:  # past its share: its own checkpoints go before anyone else's
            ranked = list(self._taking(
                (c for c in candidates if c not in taken and self.entries[c].pool == pool),
                tenant, keep, over, released, freed))
            taken.update(ranked)
        ranked += self._taking((c for c in candidates if c not in taken), tenant, keep, over,
                               released, freed)
        return self._checked(Room(fair, ranked), over)

    def _taking(self, candidates: Iterable[str], tenant: str, keep: set[PageKey], over: Over,
                released: Counter[PageKey], freed: Counter[str]) -> Iterator[str]:
        """The candidates taken, in order, until the bounds are met."""
        for cid in candidates:
            if over.met():
                return
            if self._take(cid, tenant, keep, over, released, freed):
                yield cid

    @staticmethod
    def _checked(room: Room, over: Over) -> Room:
        for bound, left in (("max_entries", over.entries), ("max_bytes", over.pages),
                            ("tenant_quota_bytes", over.quota)):
            if left > 0:
                raise DoesNotFitError(
                    bound, f"the checkpoint does not fit within {bound}: the checkpoints that "
                    "would have to go are pinned by a load or still being written")
        return room

    def _take(self, cid: str, tenant: str, keep: set[PageKey], over: Over,
              released: Counter[PageKey], freed: Counter[str]) -> bool:
        entry = self.entries[cid]
        # With only the tenant's quota over, only the tenant's own checkpoints make room.
        if over.entries <= 0 and over.pages <= 0 and entry.tenant != tenant:
            return False
        if not self.evictable(entry):
            return False
        over.entries -= 1
        for key in entry.distinct:
            released[key] += 1
            page = self.pages[key]
            if key not in keep and released[key] == len(page.holders):
                over.pages -= 1
                freed[page.pool] += 1
                if page.tenant == tenant:
                    over.quota -= 1
        return True
