"""The RAM tier's page table: per page, its slot, references, pins and state, in flat arrays.

A page is a key in the native ``KeyTable`` (its 16 bytes in a column indexed by slot) and a row of
typed arrays indexed by that slot, not an object of its own: at a million pages, an object (and
a set of holders) per page made every full garbage collection walk millions of objects on the
scheduler thread, and a dict of bytes keys cost ~115 bytes of RAM a page and a Python call per
key for every lookup. The ``KeyTable`` and the numpy columns hold no reference the collector
tracks, so it never walks them. A page's holders are a count: what the index needs of them is
whether the last one left, never who they are.

A prompt's keys are found in one native call, and what is done to every page of a prompt or of
a checkpoint (a lookup, a pin, a commit, an eviction) is one native pass over the columns
(``csrc/cpu/page_columns.cpp``) instead of a Python loop over hundreds of pages.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvci_plugin.ops._native import (
    KeyTable,
    add_pages,
    held_conflict,
    loadable_run,
    pin_pages,
    release_pages,
    unpin_pages,
    write_pages,
    written_pages,
)
from kvci_plugin.tiering.types import DoesNotFitError, PageKey, TenantMismatchError

READY = 1  # copied in: loadable
# Its tenant was forgotten while a load or a persist still pinned it: never found, loaded or held
# again, and freed at the last ``unpin``.
ERASED = 2
NO_WRITER = -1
LAST_PLAN = 2**31 - 1  # the planner's numbers fit the int32 ``kept`` column
Slots = np.ndarray  # int64 slot numbers


def column(n: int, dtype: Any, fill: Any = 0) -> np.ndarray:
    """A column of ``n`` ``fill`` values, every page of it written now (``np.zeros`` leaves
    them to be faulted in at first touch)."""
    return np.full(n, fill, dtype)


class PageTable:
    """Pages by key; their columns by slot. Slot 0 is handed out first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.keys = KeyTable(num_slots)
        # Allocated by numpy, which asks the kernel for 2 MiB pages for large arrays: a prompt's
        # pages are read all over columns of megabytes, and with 4 KiB pages each read also
        # missed the TLB. Every column is written whole here (``column``): a huge page first
        # touched later, on the scheduler thread, could stall it for the kernel to compact
        # memory (tens of milliseconds seen on a column the planner touches sparsely).
        self.v_refs = column(num_slots, np.int64)  # checkpoints referencing the page
        self.v_pins = column(num_slots, np.int64)
        self.v_state = column(num_slots, np.int8)
        # The number of the pending checkpoint whose reservation copies the bytes in
        # (``NO_WRITER`` once ready, or when that reservation was aborted while other
        # checkpoints still reference the page: the next reservation naming it copies it).
        self.v_writer = column(num_slots, np.int64, NO_WRITER)
        self.v_tenant = column(num_slots, np.int64)  # name numbers (``names``)
        self.v_pool = column(num_slots, np.int64)
        # Scratch of the fair-share planner (``room``): per page, the plan that last counted the
        # candidates taken that hold it and how many (``take_pages``), and the plan whose
        # reservation keeps it. A plan has a number of its own (``new_plan``), so nothing is
        # reset after one: the reset was a pass over every victim's pages.
        self.taken = column(num_slots, np.int64)
        self.kept = column(num_slots, np.int32)
        self._plans = 0
        self._free = array("q", range(num_slots - 1, -1, -1))
        # Tenant and pool names, numbered once each (a handful per tier).
        self.names: list[str] = []
        self._number: dict[str, int] = {}
        # Pages pinned, and pages pinned or being written: kept as they change, so that stats
        # and the eviction check read a count instead of walking pages.
        self.pinned = 0
        self.busy = 0
        self.tenant_pages: Counter[str] = Counter()
        self.pool_pages: Counter[str] = Counter()  # pages per fair-share pool (``room``)

    def __len__(self) -> int:
        return len(self.keys)

    def new_plan(self) -> int:
        """The number of the next plan's scratch: nothing earlier plans wrote counts as its own.
        Numbers fit in 31 bits: after the last, the scratch is cleared (once in two billion
        reservations) and numbering starts again."""
        if self._plans == LAST_PLAN:
            self.taken.fill(0)
            self.kept.fill(0)
            self._plans = 0
        self._plans += 1
        return self._plans

    def number(self, name: str) -> int:
        n = self._number.get(name)
        if n is None:
            n = self._number[name] = len(self.names)
            self.names.append(name)
        return n

    def known(self, name: str) -> int:
        """A name's number; one no page has for a name never seen."""
        return self._number.get(name, -1)

    def find(self, keys: Sequence[PageKey]) -> Slots:
        """The slot of each key (checked: ``keys.check_keys``), -1 for one not held."""
        return np.frombuffer(self.keys.find(keys), np.int64)

    def holds(self, key: PageKey) -> bool:
        return bool(self.find((key,))[0] >= 0)

    def keys_at(self, idx: Slots) -> list[PageKey]:
        """The keys of held pages, by their slots."""
        return self.keys.keys_at(np.ascontiguousarray(idx, np.int64))

    # ---- lookups and loads --------------------------------------------------------------------

    def prefix(self, keys: Sequence[PageKey], tenant: str) -> int:
        """How many leading ``keys`` are loadable for ``tenant``."""
        return loadable_run(self.find(keys), self.v_state, READY, self.v_tenant,
                            self.known(tenant))

    def pin_keys(self, keys: Sequence[PageKey], tenant: str) -> list[int] | tuple[int, bool]:
        """Pin every page of ``keys``, their slots; or, pinning nothing, the first page that
        cannot be loaded and whether it is another tenant's."""
        found = self.find(keys)
        run = loadable_run(found, self.v_state, READY, self.v_tenant, self.known(tenant))
        if run < len(found):
            s = int(found[run])
            return run, s >= 0 and int(self.v_tenant[s]) != self.known(tenant)
        first, busy = pin_pages(found, self.v_pins, self.v_writer, NO_WRITER)
        self.pinned += first
        self.busy += busy
        return found.tolist()

    def unpin_keys(self, keys: Sequence[PageKey]) -> Slots | None:
        """Unpin every page of ``keys``; the slots of the pages now unused (to free); None,
        changing nothing, when a page is not held or not pinned as often as ``keys`` names it."""
        idx = self.find(keys)
        if (idx < 0).any():
            return None
        done = unpin_pages(idx, self.v_pins, self.v_writer, self.v_refs, NO_WRITER)
        if done is None:
            return None
        unused, last, busy = done
        self.pinned -= last
        self.busy -= busy
        return np.frombuffer(unused, np.int64)

    # ---- stores -------------------------------------------------------------------------------

    def classify(self, keys: Sequence[PageKey],
                 tenant: str) -> tuple[list[PageKey], Slots, Slots, np.ndarray]:
        """The ``keys`` (distinct) not held, the slots of those held, each key's slot (-1: not
        held) and the positions of those not held; a held key of another tenant, or one being
        erased, refuses the reservation."""
        found = self.find(keys)
        new_at = np.flatnonzero(found < 0)  # a few tens of a prompt's hundreds of keys
        held = found[found >= 0] if new_at.size else found
        conflict = held_conflict(held, self.v_tenant, self.known(tenant), self.v_state, ERASED)
        if conflict >= 0:
            if conflict % 2 == 0:
                raise TenantMismatchError("a page key of the checkpoint belongs to another tenant")
            raise DoesNotFitError(
                "erasure", "a page of the checkpoint is still being erased (its tenant "
                "was forgotten while a load or a persist read it)")
        return [keys[i] for i in new_at.tolist()], held, found, new_at

    def add(self, keys: Sequence[PageKey], tenant: str, pool: str) -> Slots:
        """Hold new pages, one reference each (the reservation's), not ready: free slots are
        handed out in order; their slots, in the order of ``keys``."""
        n = len(keys)
        if not n:
            return np.zeros(0, np.int64)
        free = self._free
        taken = free[len(free) - n:]
        taken.reverse()
        self.keys.insert(keys, taken)
        del free[len(free) - n:]
        idx = np.frombuffer(taken, np.int64)
        add_pages(idx, self.v_refs, self.v_pins, self.v_state, self.v_writer, self.v_tenant,
                  self.v_pool, self.number(tenant), self.number(pool), NO_WRITER)
        self.tenant_pages[tenant] += n
        self.pool_pages[pool] += n
        return idx

    def write(self, idx: Slots, writer: int) -> np.ndarray:
        """A reservation's pages: those not ready with no writer are ``writer``'s to copy in;
        which of ``idx`` it copies."""
        mine, busy = write_pages(idx, self.v_state, READY, self.v_writer, writer, NO_WRITER,
                                 self.v_pins)
        self.busy += busy
        return np.frombuffer(mine, bool)

    def written(self, idx: Slots, writer: int, keys: bool) -> tuple[PageKey, ...]:
        """``writer`` copied its pages in: they are ready. The keys of those pages (none
        unless ``keys``)."""
        ready = tuple(self.keys_at(idx[self.v_writer[idx] == writer])) if keys else ()
        self.busy -= written_pages(idx, self.v_state, READY, self.v_writer, writer, NO_WRITER,
                                   self.v_pins)
        return ready

    def leave(self, idx: Slots, writer: int) -> tuple[PageKey, ...]:
        """A checkpoint numbered ``writer`` let go of the pages at ``idx``: their references go
        (its copies too), and those now unused are freed; the keys of the pages freed."""
        return self.leave_all((idx,), (writer,))[0]

    def leave_all(self, holders: Sequence[Slots],
                  writers: Sequence[int]) -> list[tuple[PageKey, ...]]:
        """``leave`` for each checkpoint in turn (its slots, its number), in one pass: a plan's
        victims go together. The keys of the pages each one freed (a page leaves with the last
        of its holders to go)."""
        unused, counts, idle = release_pages(holders, writers, self.v_refs, self.v_pins,
                                             self.v_writer, NO_WRITER)
        self.busy -= idle
        if not unused:  # most victims of a session's chain share every page with a later turn
            return [()] * len(holders)
        freed = np.frombuffer(unused, np.int64)
        keys = self.keys_at(freed)
        self.free(freed)
        out, at = [], 0
        for n in np.frombuffer(counts, np.int64).tolist():
            out.append(tuple(keys[at:at + n]))
            at += n
        return out

    def erase(self, tenant: str, keys: bool) -> tuple[PageKey, ...]:
        """Every page of ``tenant`` loses its references and copies (a forget dropped every
        checkpoint of the tenant, and a page is one tenant's): those unused are freed, those a
        load or a persist pins are ``ERASED`` and freed at their last unpin. The keys of the
        pages loadable until now, freed or erased (none unless ``keys``)."""
        number = self.known(tenant)
        if number < 0 or not self.tenant_pages.get(tenant):
            return ()
        held = np.frombuffer(self.keys.held(), np.int64)
        mine = held[self.v_tenant[held] == number]
        unloaded = tuple(self.keys_at(mine[self.v_state[mine] == READY])) if keys else ()
        pinned = self.v_pins[mine] > 0
        # Busy: pinned or being written. Their writes end here; their pins stay.
        self.busy -= int(((self.v_writer[mine] != NO_WRITER) & ~pinned).sum())
        self.v_refs[mine] = 0
        self.v_writer[mine] = NO_WRITER
        self.v_state[mine[pinned]] = ERASED
        self.free(mine[~pinned])
        return unloaded

    def all_ready(self, idx: Slots) -> bool:
        return bool((self.v_state[idx] & READY).all())

    def free(self, idx: Slots) -> None:
        """Drop unused pages (their slots): free again, their tenants and pools hold fewer."""
        if not idx.size:
            return
        idx = np.ascontiguousarray(idx, np.int64)
        self.keys.remove(idx)
        self._free.frombytes(idx.tobytes())
        for counts, column in ((self.tenant_pages, self.v_tenant), (self.pool_pages, self.v_pool)):
            # One name holding pages holds every page: nothing to count (the common case).
            freed = (((next(iter(counts)), idx.size),) if len(counts) == 1
                     else ((self.names[n], k) for n, k in tally(column[idx])))
            for name, k in freed:
                counts[name] -= k
                if not counts[name]:
                    del counts[name]

    def clear(self) -> None:
        tenant_pages, pool_pages = self.tenant_pages, self.pool_pages
        self.__init__(self.num_slots)  # type: ignore[misc]
        # The same counters, emptied: the fair-share planner holds them.
        tenant_pages.clear()
        pool_pages.clear()
        self.tenant_pages, self.pool_pages = tenant_pages, pool_pages


def tally(numbers: np.ndarray) -> Iterator[tuple[int, int]]:
    """(number, how many times) of small non-negative ``numbers`` (tenants, pools)."""
    counts = np.bincount(numbers)
    nonzero = np.flatnonzero(counts)
    return zip(nonzero.tolist(), counts[nonzero].tolist())
