"""RAMIndex under random operations, checked against a reference model after every step.

The model follows only what the index reports (reservations, evictions, pins) and checks that
the bounds hold, that every held page has its own slot, that pinned or in-flight pages are never
dropped, that the LRU order is the one loads and stores imply, and that lookups see exactly the
ready pages of the asking tenant.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import (
    DoesNotFitError,
    Erased,
    PageNotFoundError,
    TenantMismatchError,
)

T = TypeVar("T")

TENANTS = ("alice", "bob", "carol")
SLOT = 32
NUM_SLOTS = 24
MAX_PAGES = 20  # max_bytes sits below the pool so that both caps are exercised
MAX_ENTRIES = 8
QUOTA_PAGES = 10
KEYS_PER_TENANT = 40
KEYS = {
    tenant: [bytes([n]) + i.to_bytes(15, "big") for i in range(KEYS_PER_TENANT)]
    for n, tenant in enumerate(TENANTS)
}
OPS = (
    ["reserve"] * 6 + ["commit"] * 4 + ["abort"] + ["remove"] * 2 + ["pin"] * 3 + ["unpin"] * 3
    + ["get"] + ["erase"]
)


class Chooser(Protocol):
    def choice(self, options: Sequence[T]) -> T: ...

    def integer(self, lo: int, hi: int) -> int: ...


class RandomChooser:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choice(self, options: Sequence[T]) -> T:
        return self._rng.choice(options)

    def integer(self, lo: int, hi: int) -> int:
        return self._rng.randint(lo, hi)


class DataChooser:
    def __init__(self, data: st.DataObject) -> None:
        self._data = data

    def choice(self, options: Sequence[T]) -> T:
        return self._data.draw(st.sampled_from(options))

    def integer(self, lo: int, hi: int) -> int:
        return self._data.draw(st.integers(lo, hi))


def new_index() -> RAMIndex:
    return RAMIndex(
        num_slots=NUM_SLOTS,
        slot_bytes=SLOT,
        max_entries=MAX_ENTRIES,
        max_bytes=MAX_PAGES * SLOT,
        tenant_quota_bytes=QUOTA_PAGES * SLOT,
    )


@dataclass
class ModelEntry:
    tenant: str
    keys: tuple[bytes, ...]
    pending: bool


class IndexModel:
    def __init__(self, index: RAMIndex) -> None:
        self.index = index
        self.entries: dict[str, ModelEntry] = {}
        self.order: list[str] = []  # least recently used first
        self.slot_of: dict[bytes, int] = {}
        # The index records the tenant that stored a page, whatever key it was given.
        self.tenant_of: dict[bytes, str] = {}
        self.ready: set[bytes] = set()
        self.writer: dict[bytes, str] = {}
        self.pins: Counter[bytes] = Counter()
        # Pages of a forgotten tenant a load still pins: held until their last unpin.
        self.erased: set[bytes] = set()
        self.loads: list[list[bytes]] = []
        self.next_id = 0
        self.seen: Counter[str] = Counter()

    # ---- derived state ----

    def held(self) -> set[bytes]:
        held = {k for e in self.entries.values() for k in e.keys}
        return held | {k for k, n in self.pins.items() if n}

    def forget_unheld(self) -> None:
        held = self.held()
        for k in [k for k in self.slot_of if k not in held]:
            del self.slot_of[k]
            del self.tenant_of[k]
            self.ready.discard(k)
            self.writer.pop(k, None)
            self.erased.discard(k)

    def fingerprint(self) -> tuple:
        return self.index.stats(), self.index.entries()

    def expected_load_error(self, keys: Sequence[bytes], tenant: str) -> type | None:
        for k in keys:
            if k not in self.slot_of:
                return PageNotFoundError
            if self.tenant_of[k] != tenant:
                return TenantMismatchError
            if k not in self.ready:
                return PageNotFoundError
        return None

    # ---- operations ----

    def step(self, choose: Chooser) -> None:
        getattr(self, "op_" + choose.choice(OPS))(choose)

    def op_reserve(self, choose: Chooser) -> None:
        tenant = choose.choice(TENANTS)
        start = choose.integer(0, KEYS_PER_TENANT - 1)
        keys = KEYS[tenant][start : start + choose.integer(1, 6)]
        if choose.integer(0, 9) == 0:
            other = choose.choice([t for t in TENANTS if t != tenant])
            keys = keys + [KEYS[other][choose.integer(0, KEYS_PER_TENANT - 1)]]
        foreign_held = any(self.tenant_of.get(k, tenant) != tenant for k in keys)
        erased = any(k in self.erased for k in keys)
        cid = f"c{self.next_id}"
        self.next_id += 1
        before = self.fingerprint()
        try:
            res = self.index.reserve(cid, tenant, keys)
        except TenantMismatchError:
            assert foreign_held
            assert self.fingerprint() == before
            self.seen["tenant_refused"] += 1
            return
        except DoesNotFitError:
            assert self.fingerprint() == before
            # With nothing pinned or pending, anything within the bounds must fit.
            fits_alone = len(set(keys)) <= min(MAX_PAGES, QUOTA_PAGES)
            busy = any(self.pins.values()) or any(e.pending for e in self.entries.values())
            assert busy or not fits_alone, "refused although it fits"
            self.seen["does_not_fit"] += 1
            return
        assert not foreign_held and not erased
        evicted_keys: set[bytes] = set()
        for ev in res.evicted:
            if ev.trimmed:  # only its tail left, to free no more pages than wanted
                entry = self.entries[ev.checkpoint_id]
                keep = len(self.index.get(ev.checkpoint_id, entry.tenant).keys)
                assert ev.tenant == entry.tenant and 0 < keep < len(entry.keys)
                assert not entry.pending
                tail = entry.keys[keep:]
                assert not any(self.pins[k] or k in self.writer for k in tail)
                evicted_keys.update(tail)
                entry.keys = entry.keys[:keep]
                self.seen["trimmed"] += 1
                continue
            entry = self.entries.pop(ev.checkpoint_id)
            self.order.remove(ev.checkpoint_id)
            assert ev.tenant == entry.tenant
            assert not entry.pending
            assert not any(self.pins[k] or k in self.writer for k in entry.keys)
            evicted_keys.update(entry.keys)
            self.seen["evicted"] += 1
        # The pages that left: those of the evicted no remaining checkpoint (nor the new one)
        # holds, each named once.
        freed = [k for ev in res.evicted for k in ev.freed]
        still = {k for e in self.entries.values() for k in e.keys} | set(keys)
        assert len(freed) == len(set(freed))
        assert set(freed) == evicted_keys - still
        expected_new = {
            k
            for k in keys
            if k not in self.slot_of or (k not in self.ready and k not in self.writer)
        }
        assert set(res.new_keys) == expected_new
        assert set(res.reused_keys) == set(keys) - expected_new
        slot_of = dict(zip(keys, res.slots))
        assert [slot_of[k] for k in res.new_keys] == list(res.new_slots)
        assert [slot_of[k] for k in res.reused_keys] == list(res.reused_slots)
        self.entries[cid] = ModelEntry(tenant, tuple(keys), pending=True)
        self.order.append(cid)
        self.forget_unheld()
        for k, slot in zip(keys, res.slots):
            assert self.slot_of.setdefault(k, slot) == slot
            assert self.tenant_of.setdefault(k, tenant) == tenant
        for k in res.new_keys:
            self.writer[k] = cid
        self.seen["reserved"] += 1

    def op_commit(self, choose: Chooser) -> None:
        pending = [c for c, e in self.entries.items() if e.pending]
        if not pending:
            return
        cid = choose.choice(pending)
        self.index.commit(cid)
        for k in self.entries[cid].keys:
            if self.writer.get(k) == cid:
                del self.writer[k]
                self.ready.add(k)
        self.entries[cid].pending = False

    def op_abort(self, choose: Chooser) -> None:
        pending = [c for c, e in self.entries.items() if e.pending]
        if not pending:
            return
        cid = choose.choice(pending)
        self.index.abort(cid)
        for k in self.entries.pop(cid).keys:
            if self.writer.get(k) == cid:
                del self.writer[k]
        self.order.remove(cid)
        self.forget_unheld()
        self.seen["aborted"] += 1

    def op_remove(self, choose: Chooser) -> None:
        committed = [c for c, e in self.entries.items() if not e.pending]
        if not committed:
            return
        cid = choose.choice(committed)
        owner = self.entries[cid].tenant
        other = choose.choice([t for t in TENANTS if t != owner])
        try:
            self.index.remove(cid, other)
        except TenantMismatchError:
            self.seen["remove_refused"] += 1
        else:
            raise AssertionError("another tenant removed a checkpoint")
        self.index.remove(cid, owner)
        del self.entries[cid]
        self.order.remove(cid)
        self.forget_unheld()

    def op_erase(self, choose: Chooser) -> None:
        """A forget: the tenant's checkpoints go, pending ones too; its pinned pages stay,
        unloadable, until their last unpin."""
        tenant = choose.choice(TENANTS)
        ids = {c for c, e in self.entries.items() if e.tenant == tenant}
        mine = {k for k in self.held() if self.tenant_of[k] == tenant}
        pinned = {k for k in mine if self.pins[k]}
        erased = self.index.erase(tenant, unloaded_keys=True)
        assert set(erased.checkpoint_ids) == ids and len(erased.checkpoint_ids) == len(ids)
        # What was loadable stops being: freed, or erased while a load pins it.
        assert sorted(erased.unloaded) == sorted(mine & self.ready)
        for cid in ids:
            del self.entries[cid]
            self.order.remove(cid)
        for k in mine:
            self.writer.pop(k, None)
            self.ready.discard(k)
        self.erased |= pinned
        self.forget_unheld()
        self.seen["erased"] += bool(ids)
        self.seen["erased_pinned"] += bool(pinned)
        assert self.index.erase(tenant, unloaded_keys=True) == Erased((), ())

    def op_pin(self, choose: Chooser) -> None:
        tenant = choose.choice(TENANTS)
        if self.entries and choose.integer(0, 3):
            source = self.entries[choose.choice(sorted(self.entries))].keys
            keys = list(source[: choose.integer(1, len(source))])
        else:
            start = choose.integer(0, KEYS_PER_TENANT - 1)
            keys = KEYS[tenant][start : start + choose.integer(1, 3)]
        expected = self.expected_load_error(keys, tenant)
        before = self.fingerprint()
        try:
            slots = self.index.pin(keys, tenant)
        except (PageNotFoundError, TenantMismatchError) as err:
            assert type(err) is expected
            assert self.fingerprint() == before
            self.seen["pin_refused_" + type(err).__name__] += 1
            return
        assert expected is None
        assert slots == [self.slot_of[k] for k in keys]
        for k in keys:
            self.pins[k] += 1
        self.loads.append(keys)
        # The checkpoints the load read whole: those whose last page is the load's.
        touched = {c for c, e in self.entries.items() if e.keys[-1] == keys[-1]}
        self.order = [c for c in self.order if c not in touched] + [
            c for c in self.order if c in touched
        ]
        self.seen["pinned"] += 1

    def op_unpin(self, choose: Chooser) -> None:
        if not self.loads:
            return
        keys = self.loads.pop(choose.integer(0, len(self.loads) - 1))
        self.index.unpin(keys)
        self.pins.subtract(keys)
        self.forget_unheld()

    def op_get(self, choose: Chooser) -> None:
        if not self.entries:
            return
        cid = choose.choice(sorted(self.entries))
        entry = self.entries[cid]
        other = choose.choice([t for t in TENANTS if t != entry.tenant])
        try:
            self.index.get(cid, other)
        except TenantMismatchError:
            self.seen["get_refused"] += 1
        else:
            raise AssertionError("a checkpoint was returned to another tenant")
        got = self.index.get(cid, entry.tenant)
        assert (got.keys, got.pending) == (entry.keys, entry.pending)

    # ---- invariants ----

    def check(self) -> None:
        stats = self.index.stats()
        held = self.held()
        assert stats.entries == len(self.entries) <= MAX_ENTRIES
        assert stats.pages == len(held) <= MAX_PAGES
        assert stats.bytes_used == len(held) * SLOT <= stats.capacity_bytes == MAX_PAGES * SLOT
        per_tenant = Counter(self.tenant_of[k] for k in held)
        assert dict(stats.tenant_bytes) == {t: n * SLOT for t, n in per_tenant.items()}
        assert all(n <= QUOTA_PAGES for n in per_tenant.values())
        slots = [self.slot_of[k] for k in held]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < NUM_SLOTS for s in slots)
        assert stats.pinned_pages == sum(1 for n in self.pins.values() if n)
        assert stats.pending_entries == sum(1 for e in self.entries.values() if e.pending)
        assert [e.checkpoint_id for e in self.index.entries()] == self.order
        for entry in self.entries.values():
            ready_run = 0
            for k in entry.keys:
                if k not in self.ready:
                    break
                ready_run += 1
            assert self.index.longest_prefix(entry.keys, entry.tenant) == ready_run
            others = [t for t in TENANTS if t != entry.tenant]
            assert all(self.index.longest_prefix(entry.keys, t) == 0 for t in others)


def test_bounds_hold_over_10000_random_operations() -> None:
    rng = random.Random(4)
    model = IndexModel(new_index())
    choose = RandomChooser(rng)
    for _ in range(10_000):
        model.step(choose)
        model.check()
    # The run must have reached the interesting cases, or it proves little.
    for case in (
        "evicted",
        "trimmed",
        "does_not_fit",
        "tenant_refused",
        "aborted",
        "get_refused",
        "remove_refused",
        "pin_refused_TenantMismatchError",
        "pin_refused_PageNotFoundError",
        "erased",
    ):
        assert model.seen[case] > 20, (case, model.seen)
    # A forget while a load pins some of the tenant's pages.
    assert model.seen["erased_pinned"] > 5, model.seen


class RAMIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = IndexModel(new_index())

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self.model.step(DataChooser(data))

    @invariant()
    def model_agrees(self) -> None:
        self.model.check()


RAMIndexMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None
)
TestRAMIndexMachine = RAMIndexMachine.TestCase
