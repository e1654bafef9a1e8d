"""RAMCheckpointStore: the index and the pool together, bytes checked on every load."""

from __future__ import annotations

import random
import sys
import threading
import uuid
from collections import Counter

import pytest
import torch
from support.ram_store import RAMCheckpointStore

from kvci_plugin.tiering.types import (
    CheckpointNotFoundError,
    DoesNotFitError,
    PageNotFoundError,
    TenantMismatchError,
)

SLOT = 48


def key(i: int, tag: int = 0) -> bytes:
    return bytes([tag]) + i.to_bytes(15, "big")


def page(k: bytes) -> torch.Tensor:
    """Content a page key stands for (a key names one content, which is what dedup relies on)."""
    return torch.frombuffer(bytearray(k * (SLOT // len(k))), dtype=torch.uint8)


def pages(ks: list[bytes]) -> torch.Tensor:
    return torch.stack([page(k) for k in ks]) if ks else torch.empty((0, SLOT), dtype=torch.uint8)


def keys(*ids: int, tag: int = 0) -> list[bytes]:
    return [key(i, tag) for i in ids]


def store(slots: int = 8, **kwargs) -> RAMCheckpointStore:
    return RAMCheckpointStore(ram_bytes=slots * SLOT, slot_bytes=SLOT, pin_memory=False, **kwargs)


def test_put_then_load_returns_the_same_bytes() -> None:
    ram = store()
    ks = keys(1, 2, 3)
    cid = ram.put("alice", ks, pages(ks), meta={"trigger": "user"})
    assert torch.equal(ram.load(cid, "alice"), pages(ks))
    assert ram.get(cid, "alice").meta["trigger"] == "user"


def test_a_cross_tenant_load_of_a_valid_id_is_refused() -> None:
    ram = store()
    ks = keys(1, 2)
    cid = ram.put("alice", ks, pages(ks))
    with pytest.raises(TenantMismatchError):
        ram.load(cid, "mallory")
    with pytest.raises(TenantMismatchError):
        ram.get(cid, "mallory")
    with pytest.raises(TenantMismatchError):
        ram.remove(cid, "mallory")
    assert ram.load_prefix(ks, "mallory").shape == (0, SLOT)
    assert ram.longest_prefix(ks, "mallory") == 0
    # The refusals neither dropped nor pinned anything.
    assert torch.equal(ram.load(cid, "alice"), pages(ks))
    assert ram.stats().pinned_pages == 0


def test_generated_ids_are_random_uuid4_hex() -> None:
    ram = store()
    ids = {ram.put("t", keys(i), pages(keys(i))) for i in range(5)}
    assert len(ids) == 5
    for cid in ids:
        assert uuid.UUID(hex=cid).version == 4
        assert cid == uuid.UUID(hex=cid).hex


def test_shared_pages_are_stored_once() -> None:
    ram = store()
    first = keys(1, 2, 3)
    second = keys(1, 2, 4)
    a = ram.put("t", first, pages(first))
    b = ram.put("t", second, pages(second))
    assert ram.stats().bytes_used == 4 * SLOT
    ram.remove(a, "t")
    assert torch.equal(ram.load(b, "t"), pages(second))
    assert ram.stats().bytes_used == 3 * SLOT


def test_lru_eviction_through_the_store() -> None:
    ram = store(slots=4)
    a = ram.put("t", keys(1, 2), pages(keys(1, 2)))
    b = ram.put("t", keys(3, 4), pages(keys(3, 4)))
    ram.load(a, "t")
    c = ram.put("t", keys(5, 6), pages(keys(5, 6)))
    with pytest.raises(CheckpointNotFoundError):
        ram.load(b, "t")
    assert torch.equal(ram.load(a, "t"), pages(keys(1, 2)))
    assert torch.equal(ram.load(c, "t"), pages(keys(5, 6)))
    assert ram.stats().evictions == 1


def test_load_prefix_returns_the_longest_loadable_run() -> None:
    ram = store()
    ram.put("t", keys(1, 2, 3), pages(keys(1, 2, 3)))
    query = keys(1, 2, 9, 3)
    assert ram.longest_prefix(query, "t") == 2
    assert torch.equal(ram.load_prefix(query, "t"), pages(keys(1, 2)))
    assert ram.load_prefix(keys(9), "t").shape == (0, SLOT)


def test_the_tenant_quota_holds_through_the_store() -> None:
    ram = store(slots=8, tenant_quota_bytes=3 * SLOT)
    ram.put("bob", keys(1, 2, 3, tag=1), pages(keys(1, 2, 3, tag=1)))
    a = ram.put("alice", keys(1, 2), pages(keys(1, 2)))
    ram.put("alice", keys(3, 4), pages(keys(3, 4)))
    with pytest.raises(CheckpointNotFoundError):
        ram.get(a, "alice")
    assert ram.stats().tenant_bytes == {"bob": 3 * SLOT, "alice": 2 * SLOT}
    with pytest.raises(DoesNotFitError):
        ram.put("alice", keys(5, 6, 7, 8), pages(keys(5, 6, 7, 8)))


def test_a_checkpoint_larger_than_ram_is_refused_and_nothing_changes() -> None:
    ram = store(slots=2)
    cid = ram.put("t", keys(1), pages(keys(1)))
    with pytest.raises(DoesNotFitError):
        ram.put("t", keys(2, 3, 4), pages(keys(2, 3, 4)))
    assert [e.checkpoint_id for e in ram.entries()] == [cid]
    assert ram.stats().bytes_used == SLOT


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"ram_bytes": SLOT - 1, "slot_bytes": SLOT}, ValueError, "ram_bytes"),
        ({"ram_bytes": 0, "slot_bytes": SLOT}, ValueError, "ram_bytes"),
        ({"ram_bytes": 4 * SLOT, "slot_bytes": 0}, ValueError, "slot_bytes"),
        ({"ram_bytes": 4.0 * SLOT, "slot_bytes": SLOT}, TypeError, "ram_bytes"),
        ({"ram_bytes": 4 * SLOT, "slot_bytes": SLOT, "max_entries": 0}, ValueError, "max_entries"),
    ],
)
def test_bad_construction_is_refused(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        RAMCheckpointStore(pin_memory=False, **kwargs)


@pytest.mark.parametrize(
    "bad_pages",
    [
        torch.zeros((2, SLOT), dtype=torch.uint8),
        torch.zeros((3, SLOT + 1), dtype=torch.uint8),
        torch.zeros((3, SLOT), dtype=torch.int16),
        [[0] * SLOT] * 3,
    ],
)
def test_pages_that_do_not_match_the_keys_are_refused(bad_pages) -> None:
    ram = store()
    with pytest.raises((ValueError, TypeError), match="pages"):
        ram.put("t", keys(1, 2, 3), bad_pages)
    assert ram.stats().entries == 0


def test_bytes_and_bounds_hold_over_10000_random_operations() -> None:
    rng = random.Random(7)
    tenants = ("alice", "bob")
    max_entries, quota_pages, num_slots = 6, 8, 12
    ram = RAMCheckpointStore(
        ram_bytes=num_slots * SLOT + SLOT // 2,  # a partial slot is not a slot
        slot_bytes=SLOT,
        max_entries=max_entries,
        tenant_quota_bytes=quota_pages * SLOT,
        pin_memory=False,
    )
    live: dict[str, tuple[str, list[bytes]]] = {}
    seen: Counter[str] = Counter()
    for _ in range(10_000):
        op = rng.choice(("put", "put", "load", "prefix", "remove", "cross"))
        if op == "put":
            tenant = rng.choice(tenants)
            start = rng.randrange(30)
            ks = keys(*range(start, start + rng.randint(1, 10)), tag=tenants.index(tenant))
            try:
                cid = ram.put(tenant, ks, pages(ks))
            except DoesNotFitError:
                seen["refused"] += 1
            else:
                live[cid] = (tenant, ks)
            held = {e.checkpoint_id: list(e.keys) for e in ram.entries()}
            seen["evicted"] += len(live) - len(held)
            for cid, (_, ks) in live.items():  # a trimmed one holds a prefix of its keys
                if cid in held and held[cid] != ks:
                    assert held[cid] == ks[: len(held[cid])] and held[cid]
                    seen["trimmed"] += 1
            live = {c: (t, held[c]) for c, (t, _) in live.items() if c in held}
        elif live and op == "load":
            cid = rng.choice(sorted(live))
            tenant, ks = live[cid]
            assert torch.equal(ram.load(cid, tenant), pages(ks))
        elif live and op == "prefix":
            tenant, ks = live[rng.choice(sorted(live))]
            extended = ks + keys(99, tag=tenants.index(tenant))
            assert torch.equal(ram.load_prefix(extended, tenant), pages(ks))
        elif live and op == "remove":
            cid = rng.choice(sorted(live))
            ram.remove(cid, live.pop(cid)[0])
        elif live and op == "cross":
            cid = rng.choice(sorted(live))
            other = next(t for t in tenants if t != live[cid][0])
            with pytest.raises(TenantMismatchError):
                ram.load(cid, other)
            seen["cross_refused"] += 1

        stats = ram.stats()
        held_pages = {k for _, ks in live.values() for k in ks}
        assert stats.entries == len(live) <= max_entries
        assert stats.bytes_used == len(held_pages) * SLOT <= num_slots * SLOT
        assert stats.capacity_bytes == num_slots * SLOT
        assert all(b <= quota_pages * SLOT for b in stats.tenant_bytes.values())
        assert stats.pinned_pages == 0
    assert min(seen["evicted"], seen["trimmed"], seen["refused"], seen["cross_refused"]) > 50, seen


def test_concurrent_callers_see_their_own_bytes_and_leave_the_store_consistent() -> None:
    ram = store(slots=16, max_entries=8)
    failures: list[BaseException] = []
    loaded = [0] * 4

    def work(tag: int) -> None:
        rng = random.Random(tag)
        tenant = f"tenant-{tag}"
        try:
            for _ in range(200):
                start = rng.randrange(20)
                ks = keys(*range(start, start + rng.randint(1, 4)), tag=tag)
                try:
                    # Other callers' loads and stores in flight may leave no room for a moment.
                    cid = ram.put(tenant, ks, pages(ks))
                    got = ram.load(cid, tenant)
                except (DoesNotFitError, CheckpointNotFoundError, PageNotFoundError):
                    continue  # a refusal or a miss, not an error
                assert torch.equal(got, pages(ks))
                loaded[tag] += 1
        except BaseException as error:  # surfaced below: a thread's failure must fail the test
            failures.append(error)

    threads = [threading.Thread(target=work, args=(tag,)) for tag in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often so that unguarded updates would collide
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    assert min(loaded) > 50
    stats = ram.stats()
    assert stats.entries <= 8
    assert stats.pinned_pages == stats.pending_entries == 0
    held = {k for e in ram.entries() for k in e.keys}
    assert stats.bytes_used == len(held) * SLOT == sum(stats.tenant_bytes.values())
    for entry in ram.entries():
        assert torch.equal(ram.load(entry.checkpoint_id, entry.tenant), pages(list(entry.keys)))
