"""RAMIndex: the bookkeeping half of the RAM tier (keys, LRU, bounds, tenants), without bytes.

It runs on vLLM's scheduler side; the bytes live in the worker's ``PagePool`` and the two are
joined by slot ids. A store is ``reserve`` (slots chosen, evictions done) -> the worker copies the
new pages -> ``commit`` (or ``abort``); a load is ``pin`` (slots returned, tenant checked) -> the
worker copies the pages back -> ``unpin``. A page shared by several checkpoints is held once and
freed with its last reference; a slot that is being written or read is never freed.

Which checkpoint leaves first, and whether a newcomer may displace what is held, is the
``TierPolicy``'s choice (``kvci_plugin.policy``; plain LRU unless one is given). A checkpoint is
only evicted when it is committed and none of its pages is pinned or still being written,
whatever the policy's order.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress
from types import MappingProxyType
from typing import Any

import numpy as np

from kvci_plugin.ops._native import KeyTable, ref_pages, untrack_leaf
from kvci_plugin.ops.held_keys import HeldKeys
from kvci_plugin.ops.quiet import IdsByKey
from kvci_plugin.policy import HazardCounts, LRUPolicy, Offer, PolicyStats, TierPolicy
from kvci_plugin.tiering.ram.keys import check_keys, positive_int, slots_in
from kvci_plugin.tiering.ram.meta import pack_meta, unpack_meta
from kvci_plugin.tiering.ram.pages import PageTable
from kvci_plugin.tiering.ram.room import Entry, Over, Room, RoomPlanner
from kvci_plugin.tiering.types import (
    CheckpointBusyError,
    CheckpointEntry,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DoesNotFitError,
    Erased,
    Eviction,
    NotWorthDisplacingError,
    PageKey,
    PageNotFoundError,
    RAMStats,
    Reservation,
    TenantMismatchError,
    check_checkpoint_id,
    check_tenant,
)


class RAMIndex:
    """Keys, LRU order, bounds and tenants of the RAM tier; thread-safe, no torch.

    Capacity in pages is ``min(num_slots, max_bytes // slot_bytes)``; every page costs
    ``slot_bytes`` and is counted once however many checkpoints share it. ``tenant_quota_bytes``
    caps the bytes any one tenant's pages may take.
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        max_entries: int,
        max_bytes: int | None = None,
        tenant_quota_bytes: int | None = None,
        policy: TierPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._policy: TierPolicy = policy if policy is not None else LRUPolicy()
        self._clock = clock
        self._num_slots = positive_int("num_slots", num_slots)
        self._slot_bytes = positive_int("slot_bytes", slot_bytes)
        self._max_entries = positive_int("max_entries", max_entries)
        cap = slots_in("max_bytes", max_bytes, slot_bytes)
        self._page_capacity = num_slots if cap is None else min(num_slots, cap)
        self._quota_pages = slots_in("tenant_quota_bytes", tenant_quota_bytes, slot_bytes)
        self._tenant_quota_bytes = tenant_quota_bytes

        self._lock = threading.RLock()
        self._pages = PageTable(num_slots)
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        # Held checkpoints by their last key: the ones a load ending there reads whole (``pin``),
        # found without walking every checkpoint that shares the page. By the slot of their last
        # page, in a map the garbage collector never walks (``IdsByKey``).
        self._ending = IdsByKey()
        self._pending = 0  # pending entries, counted as they change (``stats``)
        self._numbered = 0  # numbers checkpoints for the page table's writers
        self._tenant_pages = self._pages.tenant_pages
        self._pool_pages = self._pages.pool_pages  # pages per fair-share pool (``room``)
        self._use_seq = 0
        self._evictions = 0
        # Moves with every call that may change what the policy counts: a reader polling its
        # counts every engine step reads them only when this has moved.
        self._policy_changes = 0

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def capacity_bytes(self) -> int:
        return self._page_capacity * self._slot_bytes

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def policy_stats(self) -> PolicyStats:
        """What the policy did, without the occupancy walk of ``stats``."""
        with self._lock:
            return self._policy.stats()

    def policy_learned(self) -> HazardCounts | None:
        """What the policy learned about the workload, for a restarted tier to start from."""
        with self._lock:
            return self._policy.learned(self._clock())

    @property
    def policy_changes(self) -> int:
        """A count that has moved whenever ``policy_stats`` may have changed its admissions,
        refusals or evictions (lookups and sightings do not move it)."""
        return self._policy_changes

    # ---- what the policy learns from -------------------------------------------------------

    def observe_lookup(self, chain: Sequence[PageKey]) -> None:
        """A request's prompt keys, once per request at its lookup (whatever it hits): the policy
        learns which remembered contexts came back."""
        with self._lock:
            self._policy.observe_lookup(chain, self._clock())

    def sight(self, offer: Offer) -> None:
        """A request finished, kept or not: the policy remembers its anchor."""
        with self._lock:
            self._policy.sighted(offer, self._clock())

    # ---- lookups -------------------------------------------------------------------------

    def longest_prefix(self, keys: Sequence[PageKey], tenant: str) -> int:
        """How many leading ``keys`` are loadable for ``tenant``. Changes nothing."""
        check_tenant(tenant)
        keys = check_keys(keys)
        with self._lock:
            return self._pages.prefix(keys, tenant)

    def absent(self, keys: Iterable[PageKey]) -> tuple[PageKey, ...]:
        """The distinct ``keys`` whose page the tier does not hold, in order. Changes nothing.
        After a reservation, the keys of its evicted checkpoints that are absent are the pages
        that left the tier: a page an evicted checkpoint shared with a held one stays."""
        keys = check_keys(keys)
        distinct = tuple(dict.fromkeys(keys))
        with self._lock:
            return tuple(compress(distinct, (self._pages.find(distinct) < 0).tolist()))

    def get(self, checkpoint_id: str, tenant: str) -> CheckpointEntry:
        """The checkpoint's record; a valid id of another tenant is refused."""
        with self._lock:
            return self._snapshot(checkpoint_id, self._owned_entry(checkpoint_id, tenant))

    def find(self, checkpoint_id: str) -> CheckpointEntry | None:
        """The checkpoint's record whatever its tenant (operator tools), None when it is not
        held: a lookup by id, never a walk of every checkpoint."""
        with self._lock:
            entry = self._entries.get(checkpoint_id)
            return None if entry is None else self._snapshot(checkpoint_id, entry)

    def entries(self, tenant: str | None = None) -> list[CheckpointEntry]:
        """Held checkpoints, least recently used first, optionally of one tenant only."""
        if tenant is not None:
            check_tenant(tenant)
        with self._lock:
            return [
                self._snapshot(cid, entry)
                for cid, entry in self._entries.items()
                if tenant is None or entry.tenant == tenant
            ]

    def stats(self) -> RAMStats:
        """Counts kept as the index changes: no walk of its pages or checkpoints."""
        with self._lock:
            n, slot = len(self._pages), self._slot_bytes
            return RAMStats(
                entries=len(self._entries), pending_entries=self._pending, pages=n,
                pinned_pages=self._pages.pinned, bytes_used=n * slot,
                capacity_bytes=self.capacity_bytes, max_entries=self._max_entries,
                slot_bytes=slot, num_slots=self._num_slots, tenant_bytes=MappingProxyType(
                    {t: k * slot for t, k in self._tenant_pages.items()}),
                tenant_quota_bytes=self._tenant_quota_bytes, evictions=self._evictions,
                policy=self._policy.stats())

    # ---- loads -----------------------------------------------------------------------------

    def pin(self, keys: Sequence[PageKey], tenant: str) -> list[int]:
        """Slots of ``keys`` for a load, pinned until ``unpin``.

        Fails closed, pinning nothing, if any page is missing, not yet copied in, or held under
        another tenant. Every checkpoint the load reads whole (its last page is the load's)
        becomes most recently used.
        """
        check_tenant(tenant)
        keys = check_keys(keys)
        with self._lock:
            slots = self._pages.pin_keys(keys, tenant)
            if isinstance(slots, tuple):
                i, other = slots
                if i == len(keys) or not self._pages.holds(keys[i]):
                    raise PageNotFoundError(f"page {i} of the load is not held in RAM")
                if other:
                    raise TenantMismatchError(f"page {i} of the load belongs to another tenant")
                raise PageNotFoundError(f"page {i} of the load is not copied in yet")
            # Only the checkpoints the load read whole were used (those ending at its last
            # page): one that goes on past it (a later turn, another user behind the same
            # system prompt) keeps its place, or a hit on a shared prefix would keep every
            # holder's tail with it.
            ending = self._ending.get(slots[-1]) if slots else ()
            if ending:
                self._touch(set(ending))
            return slots

    def unpin(self, keys: Sequence[PageKey]) -> None:
        """End a load started by ``pin`` with the same keys."""
        keys = check_keys(keys)
        with self._lock:
            unused = self._pages.unpin_keys(keys)
            if unused is None:
                raise ValueError("unpin: a page is not pinned (unpin without a matching pin)")
            self._pages.free(unused)

    # ---- stores ----------------------------------------------------------------------------

    def reserve(
        self,
        checkpoint_id: str,
        tenant: str,
        keys: Sequence[PageKey],
        meta: Mapping[str, Any] | None = None,
        offer: Offer | None = None,
        pool: str | None = None,
    ) -> Reservation:
        """Make room for a checkpoint and choose the slots its new pages go to.

        Pages already held for ``tenant`` are reused; a key held under another tenant is
        refused. Checkpoints are evicted in the policy's order until the entry count, the bytes
        and the tenant's quota hold. If that is impossible, ``DoesNotFitError`` is raised; if the
        policy finds ``offer`` worth less than what it would evict, ``NotWorthDisplacingError``;
        either way nothing changes. ``offer`` says what the policy weighs (None: a plain offer
        anchored at the last key). The checkpoint is pending until ``commit`` or ``abort``.
        """
        check_checkpoint_id(checkpoint_id)
        check_tenant(tenant)
        keys = check_keys(keys)
        if not keys:
            raise ValueError("keys must not be empty: a checkpoint holds at least one page")
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a mapping, not {type(meta).__name__}")
        distinct, order = _distinct(keys)
        with self._lock:
            if checkpoint_id in self._entries:
                raise CheckpointExistsError(f"checkpoint_id {checkpoint_id!r} is already held")
            new_keys, held, found, new_at = self._pages.classify(distinct, tenant)
            now = self._clock()
            pool = tenant if pool is None else pool
            room = self._plan_room(tenant, pool, held, len(distinct), len(new_keys), now)
            offer = offer if offer is not None else Offer(anchor=keys[-1])
            self._policy_changes += 1
            # What fair shares take needs no weighing: only the policy's own choice can be vetoed.
            if not self._policy.admits(
                    offer, room.ranked, now,
                    set(room.ranked).difference(room.idle) if room.idle else None):
                raise NotWorthDisplacingError(
                    "the checkpoint is worth less than the checkpoints it would evict")
            t = self._pages
            # Hold the reused pages first so that evicting their other holders keeps them.
            ref_pages(held, t.v_refs)
            trim = room.trim
            evicted = self._evict([cid for cid in room.victims
                                   if trim is None or cid != trim[0]])
            self._evictions += len(evicted)
            if trim is not None:
                evicted += (self._trim(*trim),)
            idx, mine = self._hold(checkpoint_id, tenant, pool, found, new_at, order, new_keys,
                                   meta, now)
            self._policy.admitted(checkpoint_id, offer, now)
            return Reservation(
                checkpoint_id=checkpoint_id, tenant=tenant,
                # The new pages are the reservation's to copy, and most often they alone are.
                new_keys=(tuple(new_keys) if np.count_nonzero(mine) == len(new_keys)
                          else tuple(compress(distinct, mine.tolist()))),
                new_slots=tuple(idx[mine].tolist()), evicted=evicted, distinct=distinct,
                distinct_slots=idx, fresh=mine, order=order)

    def _hold(self, checkpoint_id: str, tenant: str, pool: str, found: np.ndarray,
              new_at: np.ndarray, order: np.ndarray | None, new_keys: list[PageKey],
              meta: Mapping[str, Any] | None, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Hold the new pages and the pending entry, after the evictions; the entry's slots
        and which of them its reservation copies in. ``found``: each distinct key's slot
        before (-1: new, at ``new_at``; the held ones were referenced before the evictions, so
        they stay)."""
        t = self._pages
        self._numbered += 1
        num = self._numbered
        idx = found.copy()
        idx[new_at] = t.add(new_keys, tenant, pool)
        mine = t.write(idx, num)
        self._use_seq += 1
        entry = self._entries[checkpoint_id] = Entry(
            tenant=tenant, pool=pool, created=now, last_used=now, use_seq=self._use_seq,
            pending=True, meta=pack_meta(meta), num=num, slots=idx.astype(np.int32),
            order=order, last_slot=int(idx[-1] if order is None else idx[order[-1]]))
        untrack_leaf(entry)  # its fields are leaves: young collections need not walk it
        self._pending += 1
        self._ending.add(entry.last_slot, checkpoint_id)
        return idx, mine

    def retained(self, checkpoint_id: str) -> None:
        """An order holds the checkpoint (``Retentions``): told to the policy."""
        with self._lock:
            self._policy.retained(checkpoint_id)

    def commit(self, checkpoint_id: str, *, ready_keys: bool = False) -> tuple[PageKey, ...]:
        """The worker copied the reservation's new pages: they become loadable. With
        ``ready_keys``, the keys of the pages loadable from now on (those this reservation
        copied in: the others were loadable already, or are another store's to copy)."""
        with self._lock:
            entry = self._pending_entry(checkpoint_id)
            ready = self._pages.written(entry.slots, entry.num, ready_keys)
            entry.pending = False
            self._pending -= 1
            return ready

    def keep_resent_prefix(self, checkpoint_id: str, prefix_id: str) -> bool:
        """After the system's checkpoint ``checkpoint_id`` committed: keep the leading pages the
        policy names (``TierPolicy.resent_prefix``) as checkpoint ``prefix_id`` too, with the
        same meta. Its pages are held already, so nothing is copied; and it never displaces
        anything: with no entry left under the bound, nothing is kept. Whether it was kept."""
        with self._lock:
            entry = self._entry(checkpoint_id)
            if entry.pending:
                raise CheckpointBusyError(
                    f"checkpoint {checkpoint_id!r} is pending: commit it first")
            if len(self._entries) >= self._max_entries:
                return False
            # The policy probes its slots' keys in the page table: no key object a page.
            held = HeldKeys(self._pages.keys, entry.key_slots)
            found = self._policy.resent_prefix(held)
            if found is None:
                return False
            n, offer = found
            self.reserve(prefix_id, entry.tenant, held[:n].keys(), unpack_meta(entry.meta),
                         offer=offer)
            self.commit(prefix_id)
            return True

    def abort(self, checkpoint_id: str) -> None:
        """The store failed: drop the checkpoint and free the pages only it referenced."""
        with self._lock:
            self._pending_entry(checkpoint_id)
            self._drop(checkpoint_id)

    def remove(self, checkpoint_id: str, tenant: str) -> None:
        """Drop a committed checkpoint; pages still pinned by a load are freed at ``unpin``.
        Like a load, refused for a valid id of another tenant."""
        with self._lock:
            entry = self._owned_entry(checkpoint_id, tenant)
            if entry.pending:
                raise CheckpointBusyError(
                    f"checkpoint {checkpoint_id!r} is pending: abort it instead of removing it"
                )
            self._drop(checkpoint_id)

    def erase(self, tenant: str, *, unloaded_keys: bool = False) -> Erased:
        """A forget: drop every checkpoint of ``tenant``, pending ones too; their ids, and the
        keys of the pages loadable until now when ``unloaded_keys``. Pages a load or a persist
        still pins are erased: no lookup finds them, no pin or reservation takes them, and they
        are freed at their last ``unpin``.

        A page is one tenant's, so every page of the tenant's checkpoints goes: the pages are
        let go of in one pass over the page columns, not checkpoint by checkpoint, and no
        record of a checkpoint is built (at 10^6 pages, snapshots of 20,000 checkpoints with
        their keys held the lock for seconds)."""
        check_tenant(tenant)
        with self._lock:
            ids = tuple(cid for cid, e in self._entries.items() if e.tenant == tenant)
            for cid in ids:
                entry = self._entries.pop(cid)
                self._policy.dropped(cid, evicted=False)
                if entry.pending:
                    self._pending -= 1
                self._ending.discard(entry.last_slot, cid)
            self._policy_changes += bool(ids)
            return Erased(checkpoint_ids=ids, unloaded=self._pages.erase(tenant, unloaded_keys))

    def clear(self) -> tuple[tuple[str, str], ...]:
        """Forget every checkpoint, pending or pinned ones too (a cache reset); returns their ids
        and tenants.

        The caller makes sure nothing still loads from or copies into a slot when a new store
        may take it: the connector's copies run in step order, so a slot freed now is written
        again only after the jobs already sent."""
        with self._lock:
            ids = tuple((cid, entry.tenant) for cid, entry in self._entries.items())
            self._entries.clear()
            self._pages.clear()
            self._ending.clear()
            self._pending = 0
            self._tenant_pages.clear()
            self._pool_pages.clear()
            self._policy.cleared()
            self._policy_changes += 1
            return ids

    def set_meta(self, checkpoint_id: str, **values: Any) -> None:
        """Attach or replace metadata on a held checkpoint (trigger, recommendation, refusal...)."""
        with self._lock:
            entry = self._entry(checkpoint_id)
            entry.meta = pack_meta({**unpack_meta(entry.meta), **values})

    # ---- internals (caller holds the lock) -------------------------------------------------

    def _entry(self, checkpoint_id: str) -> Entry:
        check_checkpoint_id(checkpoint_id)
        entry = self._entries.get(checkpoint_id)
        if entry is None:
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held in RAM")
        return entry

    def _owned_entry(self, checkpoint_id: str, tenant: str) -> Entry:
        check_tenant(tenant)
        entry = self._entry(checkpoint_id)
        if entry.tenant != tenant:
            raise TenantMismatchError(
                f"checkpoint {checkpoint_id!r} belongs to another tenant: refused"
            )
        return entry

    def _pending_entry(self, checkpoint_id: str) -> Entry:
        entry = self._entry(checkpoint_id)
        if not entry.pending:
            raise CheckpointBusyError(f"checkpoint {checkpoint_id!r} is already committed")
        return entry

    def _snapshot(self, checkpoint_id: str, entry: Entry) -> CheckpointEntry:
        return CheckpointEntry(
            checkpoint_id=checkpoint_id,
            tenant=entry.tenant,
            keys=self._keys_of(entry),
            nbytes=len(entry.slots) * self._slot_bytes,
            created=entry.created,
            last_used=entry.last_used,
            pending=entry.pending,
            complete=not entry.pending and self._pages.all_ready(entry.slots),
            meta=MappingProxyType(unpack_meta(entry.meta)),
        )

    def _keys_of(self, entry: Entry) -> tuple[PageKey, ...]:
        return tuple(self._pages.keys_at(entry.key_slots))

    def _touch(self, checkpoint_ids: set[str]) -> None:
        now = self._clock()
        # Keep the touched checkpoints' relative order: the older stays older.
        ordered = sorted(checkpoint_ids, key=lambda c: self._entries[c].use_seq)
        self._policy.touched(tuple(ordered), now)
        for cid in ordered:
            self._use_seq += 1
            entry = self._entries[cid]
            entry.use_seq = self._use_seq
            entry.last_used = now
            self._entries.move_to_end(cid)

    def _plan_room(
        self, tenant: str, pool: str, held: np.ndarray, need: int, n_new: int, now: float
    ) -> Room:
        """Checkpoints to evict so that ``need`` pages fit, ``n_new`` of them new and those of
        ``held`` (slots) held already: fair shares first (``room``)."""
        if need > self._page_capacity:
            raise DoesNotFitError("max_bytes", f"the checkpoint needs {need * self._slot_bytes} "
                                  f"bytes; the RAM tier holds {self.capacity_bytes}")
        if self._quota_pages is not None and need > self._quota_pages:
            raise DoesNotFitError(
                "tenant_quota_bytes", f"the checkpoint needs {need * self._slot_bytes} bytes; "
                f"the tenant quota is {self._tenant_quota_bytes}")
        over = Over(
            entries=len(self._entries) + 1 - self._max_entries,
            pages=len(self._pages) + n_new - self._page_capacity,
            quota=(self._tenant_pages[tenant] + n_new - self._quota_pages
                   if self._quota_pages is not None else 0),
        )
        if over.met():
            return Room([], [])
        return self._planner().plan(tenant, pool, held, n_new, over,
                                    self._policy.eviction_order(self._entries, now))

    def _planner(self) -> RoomPlanner:
        return RoomPlanner(
            self._entries, self._pages, self._pool_pages, self._page_capacity)

    def fair_share_bytes(self, pool: str) -> int:
        """A pool's fair share of the tier now (split among the pools holding pages and it)."""
        with self._lock:
            return self._planner().share(pool) * self._slot_bytes

    def _trim(self, checkpoint_id: str, keep: int) -> Eviction:
        """Free the checkpoint's pages past its first ``keep`` for room: it holds the prefix on.
        (Only a checkpoint whose keys do not repeat is trimmed: its slots are its keys'.)"""
        entry, t = self._entries[checkpoint_id], self._pages
        keys = t.leave(entry.slots[keep:], entry.num)
        self._ending.discard(entry.last_slot, checkpoint_id)
        entry.slots = entry.slots[:keep].copy()
        entry.last_slot = int(entry.slots[-1])
        self._ending.add(entry.last_slot, checkpoint_id)
        self._policy.trimmed(checkpoint_id, t.keys_at(entry.slots[-1:])[0])
        self._policy_changes += 1
        return Eviction(checkpoint_id=checkpoint_id, tenant=entry.tenant, freed=keys, trimmed=True)

    def _evict(self, victims: list[str]) -> tuple[Eviction, ...]:
        """A plan's victims dropped, their pages let go of in one pass (a plan evicts a dozen at
        times, most of them sharing every page with a checkpoint that stays)."""
        return self._let_go(victims, evicted=True) if victims else ()

    def _drop(self, checkpoint_id: str) -> Eviction:
        """A checkpoint aborted or removed (not evicted)."""
        return self._let_go([checkpoint_id], evicted=False)[0]

    def _let_go(self, checkpoint_ids: list[str], *, evicted: bool) -> tuple[Eviction, ...]:
        entries, policy = self._entries, self._policy
        gone = [entries.pop(cid) for cid in checkpoint_ids]
        for cid, entry in zip(checkpoint_ids, gone):
            policy.dropped(cid, evicted=evicted)
            if entry.pending:  # an abort's (a plan never takes a pending one)
                self._pending -= 1
            self._ending.discard(entry.last_slot, cid)
        self._policy_changes += len(checkpoint_ids)
        freed = self._pages.leave_all([e.slots for e in gone], [e.num for e in gone])
        return tuple(Eviction(checkpoint_id=cid, tenant=entry.tenant, freed=keys)
                     for cid, entry, keys in zip(checkpoint_ids, gone, freed))


def _distinct(keys: tuple[PageKey, ...]) -> tuple[tuple[PageKey, ...], np.ndarray | None]:
    """``keys`` once each, in order, and where each key is among them (None when no key
    repeats: chained prefix keys never do)."""
    if KeyTable.distinct(keys):
        return keys, None
    distinct = tuple(dict.fromkeys(keys))
    at = {key: i for i, key in enumerate(distinct)}
    return distinct, np.fromiter(map(at.__getitem__, keys), np.int32, len(keys))
