"""The RAM tier's records, and how room is made for a new checkpoint: fair shares first.

Room is made under pressure only: while pages are free, any tenant may hold more than its
share (the tier is work-conserving). When a reservation needs room, it comes first from the
**pools** over their fair share — the tier's pages split evenly among the pools holding pages
and the one asking — explicit and retained-free checkpoints of theirs included, whatever the
policy would have kept: an explicit checkpoint is no shield against another tenant's work.
A pool is a verified tenant, or every declared (unverified) tenant together: renaming a declared
tenant buys no second share. A pool within its share then takes room in the policy's own order
(the policy may still refuse to displace what it values more); a pool over its share takes
room only from its own checkpoints and from other pools over their share, never from a pool
within its share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
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
        candidates = list(order)
        fair: list[str] = []
        for cid in candidates:  # other pools' checkpoints past their share, until within it
            if over.met():
                break
            p = self.entries[cid].pool
            if excess.get(p, 0) > freed[p] and self._take(cid, tenant, keep, over, released, freed):
                fair.append(cid)
        taken = set(fair)
        ranked: list[str] = []
        for cid in candidates:  # then the policy's order (over its share: its own, and pools
            if over.met():      # still past theirs)
                break
            p = self.entries[cid].pool
            if cid in taken or asker_over and p != pool and excess.get(p, 0) <= freed[p]:
                continue
            if self._take(cid, tenant, keep, over, released, freed):
                ranked.append(cid)
        for bound, left in (("max_entries", over.entries), ("max_bytes", over.pages),
                            ("tenant_quota_bytes", over.quota)):
            if left > 0:
                raise DoesNotFitError(bound, _why(bound, asker_over))
        return Room(fair, ranked)

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


def _why(bound: str, over_share: bool) -> str:
    if over_share:
        return (f"the checkpoint does not fit within {bound}: its tenant holds its fair share of "
                "the RAM tier already, and the rest is other tenants' within their shares (or "
                "pinned by a load, or still being written)")
    return (f"the checkpoint does not fit within {bound}: the checkpoints that would have to go "
            "are pinned by a load or still being written")
