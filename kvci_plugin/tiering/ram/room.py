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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvci_plugin.ops._native import take_pages
from kvci_plugin.tiering.ram.pages import NO_WRITER, PageTable, Slots, tally
from kvci_plugin.tiering.types import DoesNotFitError

DECLARED_POOL = "\0declared"
"""The pool of every declared (unverified) tenant: no valid tenant name has a NUL in it."""

SLACK_SHIFT = 12
SLACK_MIN_PAGES = 64
"""A large tier's trim frees 1/4096 of the tier more than the reservation wants (``slack``)."""


def slack(capacity: int) -> int:
    """The pages a trim frees past what is wanted in a tier of ``capacity`` pages: a plan, its
    trim and the policy's weighing were most of a store's time on the scheduler thread, and
    a little room left free lets the next stores (tens of new pages each) skip them. Less than
    ``SLACK_MIN_PAGES`` would spare no plan: a smaller tier keeps every page it can."""
    pages = capacity >> SLACK_SHIFT
    return pages if pages >= SLACK_MIN_PAGES else 0


@dataclass(slots=True)
class Entry:
    """A held checkpoint. Its keys are not kept here: its pages' slots name them in the page
    table (``PageTable.keys_at``), so that a checkpoint costs 4 bytes a page, not a key object
    and a reference (the connector computes each request's keys anew: they are never shared)."""

    tenant: str
    pool: str
    created: float
    last_used: float
    # Orders touches made in the same instant; the OrderedDict holds the LRU order itself.
    use_seq: int
    pending: bool
    # What ``set_meta`` attached, packed (``ram.meta``): one object, not a tree of them.
    meta: Any
    # The checkpoint's number: the page table names a page's writer by it.
    num: int = 0
    # The slots of its distinct pages, in the order of their first key: a held page keeps its
    # slot (int32: a tier has under 2^31 slots).
    slots: Slots = field(default_factory=lambda: np.zeros(0, np.int32))
    # Where each key's page is in ``slots``, when a key repeats; None when none does (chained
    # prefix keys never do).
    order: np.ndarray | None = None
    # Its last key's slot (``RAMIndex`` finds checkpoints by where they end), set with ``slots``.
    last_slot: int = -1

    @property
    def key_slots(self) -> Slots:
        """The slot of each of its keys, in order."""
        return self.slots if self.order is None else self.slots[self.order]


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
    # The last victim, when it frees more pages than the bounds want: (its id, how many of its
    # leading pages it keeps); only its tail leaves.
    trim: tuple[str, int] | None = None
    # Victims taking which frees no page: each page of theirs stays (the reservation reuses it,
    # or a checkpoint that stays holds it) or leaves with a later victim, its last holder.
    idle: frozenset[str] = frozenset()

    @property
    def victims(self) -> list[str]:
        return self.fair + self.ranked


@dataclass
class RoomPlanner:
    """One reservation's room: ``order`` is the policy's eviction order of ``entries``."""

    entries: Mapping[str, Entry]
    pages: PageTable
    pool_pages: Counter[str]
    capacity: int
    # The last candidate taken for pages alone: its id and the positions of the pages it frees.
    _last: tuple[str, np.ndarray] | None = None
    # The candidates taken that freed no page (``Room.idle``).
    _idle: list[str] = field(default_factory=list)
    _plan_no: int = 0  # this plan's number in the page table's scratch (``PageTable.new_plan``)

    def share(self, pool: str) -> int:
        """The pages a pool's fair share is now: the tier split among the pools holding pages
        and ``pool``."""
        return max(1, self.capacity // len(self._active(pool)))

    def _active(self, pool: str) -> set[str]:
        return {p for p, n in self.pool_pages.items() if n > 0} | {pool}

    def plan(self, tenant: str, pool: str, keep: Slots, n_new: int, over: Over,
             order: Iterable[str]) -> Room:
        """``keep``: the slots of the reservation's pages already held (they stay)."""
        if over.met():
            return Room([], [])
        self._plan_no = self.pages.new_plan()
        self.pages.kept[keep] = self._plan_no
        self._idle = []
        room = self._trimmed(self._planned(tenant, pool, n_new, over, order), over)
        return replace(room, idle=frozenset(self._idle)) if self._idle else room

    def _planned(self, tenant: str, pool: str, n_new: int, over: Over,
                 order: Iterable[str]) -> Room:
        share = self.share(pool)
        excess = {p: n - share for p, n in self.pool_pages.items() if p != pool and n > share}
        # Alone, a pool's share is the whole tier: the policy's order is all there is.
        asker_over = (len(self._active(pool)) > 1
                      and self.pool_pages[pool] + n_new > share)
        if not excess and not asker_over:  # the common case: the policy's order, taken lazily
            return self._checked(Room([], self._taking(order, tenant, over, None)), over)
        freed: Counter[str] = Counter()
        candidates = list(order)
        # Other pools' checkpoints past their share, until each is back within it.
        fair = self._taking(
            (c for c in candidates if excess.get(self.entries[c].pool, 0)
             > freed[self.entries[c].pool]), tenant, over, freed)
        taken = set(fair)
        ranked = []
        if asker_over:  # past its share: its own checkpoints go before anyone else's
            ranked = self._taking(
                (c for c in candidates if c not in taken and self.entries[c].pool == pool),
                tenant, over, freed)
            taken.update(ranked)
        ranked += self._taking((c for c in candidates if c not in taken), tenant, over, freed)
        return self._checked(Room(fair, ranked), over)

    def _taking(self, candidates: Iterable[str], tenant: str, over: Over,
                freed: Counter[str] | None) -> list[str]:
        """The candidates taken, in order, until the bounds are met; ``freed`` counts the pages
        each pool gives up (None: no fair share is weighed)."""
        taken = []
        for cid in candidates:
            if over.met():
                break
            if self._take(cid, tenant, over, freed):
                taken.append(cid)
        return taken

    def _trimmed(self, room: Room, over: Over) -> Room:
        """``room``, its last victim trimmed when it frees more pages than wanted: it keeps its
        leading pages up to the spare count of those it would free (less the tier's ``slack``),
        as a block-level LRU keeps a prompt's head and drops its tail (evicting it whole left
        pages unused until the next reservation, ~3 % of the tier on the agent trace at a tenth
        of its working set, and cost hits a block LRU kept)."""
        if self._last is None or over.pages >= 0:
            return room
        cid, gone = self._last
        spare = -over.pages
        if len(gone) <= spare or self.entries[cid].order is not None:
            return room  # it frees only spare pages, or repeats a key: it leaves whole
        # Of the pages it would free, it keeps those spare less the tier's slack (its first).
        kept = max(0, spare - slack(self.capacity))
        if gone[kept] == 0:
            return room  # it would keep no page: it leaves whole
        return Room(room.fair, room.ranked, trim=(cid, int(gone[kept])))

    @staticmethod
    def _checked(room: Room, over: Over) -> Room:
        for bound, left in (("max_entries", over.entries), ("max_bytes", over.pages),
                            ("tenant_quota_bytes", over.quota)):
            if left > 0:
                raise DoesNotFitError(
                    bound, f"the checkpoint does not fit within {bound}: the checkpoints that "
                    "would have to go are pinned by a load or still being written")
        return room

    def _take(self, cid: str, tenant: str, over: Over, freed: Counter[str] | None) -> bool:
        entry = self.entries[cid]
        # With only the tenant's quota over, only the tenant's own checkpoints make room.
        if over.entries <= 0 and over.pages <= 0 and entry.tenant != tenant:
            return False
        if entry.pending:
            return False
        table, idx = self.pages, entry.slots
        # Each page counts the candidates taken that hold it: taken by all its holders, and
        # not one the reservation keeps, it is freed. A page pinned or being written keeps its
        # holder (None: nothing counted).
        taken = take_pages(idx, table.taken, table.v_refs, table.kept, self._plan_no,
                           table.v_pins, table.v_writer, NO_WRITER)
        if taken is None:
            return False
        frees = np.frombuffer(taken, np.int64)
        pages_only = over.entries <= 0 and over.quota <= 0
        over.entries -= 1
        self._last = (cid, frees) if pages_only else None
        if not frees.size:
            self._idle.append(cid)
            return True
        over.pages -= frees.size
        if freed is not None or over.quota > 0:  # a quota met stays met: nothing to count
            gone = idx[frees]
            if freed is not None:
                for p, k in tally(table.v_pool[gone]):
                    freed[table.names[p]] += k
            if over.quota > 0:
                over.quota -= int((table.v_tenant[gone] == table.known(tenant)).sum())
        return True
