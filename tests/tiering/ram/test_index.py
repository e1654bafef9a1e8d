"""RAMIndex: dedup, LRU at checkpoint granularity, bounds, pins, pending stores, tenants."""

from __future__ import annotations

import pytest

from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.room import slack
from kvci_plugin.tiering.types import (
    CheckpointBusyError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DoesNotFitError,
    PageNotFoundError,
    TenantMismatchError,
)

SLOT = 64


def key(i: int, tag: int = 0) -> bytes:
    return bytes([tag]) + i.to_bytes(15, "big")


def keys(*ids: int, tag: int = 0) -> list[bytes]:
    return [key(i, tag) for i in ids]


def stored(index: RAMIndex, cid: str, tenant: str, ks: list[bytes]) -> None:
    index.reserve(cid, tenant, ks)
    index.commit(cid)


def ids(index: RAMIndex, tenant: str | None = None) -> list[str]:
    return [e.checkpoint_id for e in index.entries(tenant)]


def test_shared_page_is_held_once_and_freed_with_its_last_reference() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    first = index.reserve("a", "t", keys(1, 2, 3))
    assert list(first.new_keys) == keys(1, 2, 3)
    assert first.reused_keys == first.reused_slots == ()
    index.commit("a")

    second = index.reserve("b", "t", keys(1, 2, 4))
    assert list(second.new_keys) == keys(4)
    assert second.new_slots == second.slots[2:]
    assert dict(zip(second.reused_keys, second.reused_slots)) == {
        key(1): first.slots[0], key(2): first.slots[1]}
    assert second.slots[:2] == first.slots[:2]
    assert second.slots[2] not in first.slots
    index.commit("b")
    assert index.stats().pages == 4
    assert index.stats().bytes_used == 4 * SLOT
    assert index.get("b", "t").nbytes == 3 * SLOT

    index.remove("a", "t")
    assert index.stats().pages == 3
    assert index.longest_prefix(keys(1, 2, 4), "t") == 3
    assert index.longest_prefix(keys(3), "t") == 0

    index.remove("b", "t")
    stats = index.stats()
    assert (stats.pages, stats.bytes_used, stats.entries) == (0, 0, 0)
    assert stats.tenant_bytes == {}
    # Every slot is free again: a checkpoint filling the whole pool fits without evicting.
    full = index.reserve("c", "t", keys(*range(10, 18)))
    assert sorted(full.slots) == list(range(8))
    assert full.evicted == ()


def test_all_pages_deduplicated_is_a_checkpoint_with_nothing_to_copy() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    stored(index, "a", "t", keys(1, 2))
    again = index.reserve("b", "t", keys(1, 2))
    assert again.new_keys == again.new_slots == ()
    index.commit("b")
    assert index.get("b", "t").complete
    assert index.stats().pages == 2


def test_a_key_repeated_within_a_checkpoint_takes_one_slot() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    res = index.reserve("a", "t", keys(1, 2, 1))
    assert res.slots[0] == res.slots[2]
    assert len(res.new_keys) == len(res.new_slots) == 2
    index.commit("a")
    assert index.stats().pages == 2
    # A load naming the key twice pins its page twice; the page stays pinned until both go.
    assert index.pin(keys(1, 2, 1), "t") == list(res.slots)
    assert index.stats().pinned_pages == 2
    with pytest.raises(ValueError, match="not pinned"):
        index.unpin(keys(1, 1, 1))  # one pin more than the load took: nothing changes
    index.remove("a", "t")
    assert index.stats().pages == 2  # pinned: freed at the last unpin
    index.unpin(keys(1, 2, 1))
    assert (index.stats().pages, index.stats().pinned_pages) == (0, 0)


def test_lru_evicts_the_least_recently_used_checkpoint_and_a_load_touches() -> None:
    index = RAMIndex(num_slots=16, slot_bytes=SLOT, max_entries=3)
    stored(index, "a", "t", keys(1, 2))
    stored(index, "b", "t", keys(3, 4))
    stored(index, "c", "t", keys(5, 6))
    index.pin(keys(1, 2), "t")
    index.unpin(keys(1, 2))
    assert ids(index) == ["b", "c", "a"]

    res = index.reserve("d", "t", keys(7))
    evicted = [(e.checkpoint_id, e.tenant, e.freed) for e in res.evicted]
    assert evicted == [("b", "t", tuple(keys(3, 4)))]
    assert ids(index) == ["c", "a", "d"]
    assert index.longest_prefix(keys(3), "t") == 0
    assert index.stats().evictions == 1


def test_a_load_touches_the_checkpoints_it_reads_whole_and_keeps_their_order() -> None:
    index = RAMIndex(num_slots=16, slot_bytes=SLOT, max_entries=8)
    stored(index, "a", "t", keys(1))
    stored(index, "b", "t", keys(1, 3))  # goes on past the load: its tail was not read
    stored(index, "c", "t", keys(1))
    stored(index, "d", "t", keys(4))
    before = index.get("a", "t").last_used
    index.pin(keys(1), "t")
    index.unpin(keys(1))
    assert ids(index) == ["b", "d", "a", "c"]
    assert index.get("a", "t").last_used >= before
    # The eviction order follows: "b" leaves first though it holds the page just read.
    small = RAMIndex(num_slots=3, slot_bytes=SLOT, max_entries=2)
    stored(small, "a", "t", keys(1))
    stored(small, "b", "t", keys(1, 3))
    small.pin(keys(1), "t")
    small.unpin(keys(1))
    assert [e.checkpoint_id for e in small.reserve("c", "t", keys(6)).evicted] == ["b"]


def test_the_byte_bound_evicts_only_as_much_as_needed() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(1, 2))
    stored(index, "b", "t", keys(3, 4))
    res = index.reserve("c", "t", keys(5, 6))
    assert [e.checkpoint_id for e in res.evicted] == ["a"]
    index.commit("c")
    res = index.reserve("d", "t", keys(7, 8, 9))
    # "b" leaves; "c" frees one page more than wanted, so only its tail leaves.
    assert [(e.checkpoint_id, e.freed, e.trimmed) for e in res.evicted] == [
        ("b", tuple(keys(3, 4)), False), ("c", tuple(keys(6)), True)]
    assert index.stats().bytes_used == 4 * SLOT
    assert index.stats().evictions == 2  # "a" and "b": a trimmed checkpoint is still held
    index.commit("d")
    assert index.get("c", "t").keys == tuple(keys(5))
    assert index.longest_prefix(keys(5, 6), "t") == 1


def test_a_trimmed_checkpoint_frees_only_its_own_tail_and_keeps_what_others_share() -> None:
    index = RAMIndex(num_slots=6, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(1, 2, 3, 4))
    stored(index, "b", "t", keys(1, 2, 5))  # shares the head of "a"
    stored(index, "x", "t", keys(9))
    res = index.reserve("c", "t", keys(7))  # one page wanted: "a" (least recent) frees 3, 4
    (gone,) = res.evicted
    assert (gone.checkpoint_id, gone.freed, gone.trimmed) == ("a", tuple(keys(4)), True)
    assert index.absent(keys(1, 2, 3, 4)) == tuple(keys(4))
    index.commit("c")
    assert index.get("a", "t").keys == tuple(keys(1, 2, 3))
    assert index.longest_prefix(keys(1, 2, 3, 4), "t") == 3
    assert index.longest_prefix(keys(1, 2, 5), "t") == 3  # "b" untouched
    # It keeps its place, first to leave; freeing exactly the page wanted (1 and 2 are "b"'s
    # too), it leaves whole.
    (gone,) = index.reserve("d", "t", keys(8)).evicted
    assert (gone.checkpoint_id, gone.freed, gone.trimmed) == ("a", tuple(keys(3)), False)
    assert "a" not in ids(index)
    index.commit("d")
    # Two wanted: "b" frees three, so it keeps its head.
    (gone,) = index.reserve("e", "t", keys(10, 11)).evicted
    assert (gone.checkpoint_id, gone.freed, gone.trimmed) == ("b", tuple(keys(2, 5)), True)
    assert index.get("b", "t").keys == tuple(keys(1))


def test_evicting_a_checkpoint_keeps_pages_the_new_one_reuses() -> None:
    index = RAMIndex(num_slots=3, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(1, 2))
    stored(index, "b", "t", keys(3))
    res = index.reserve("c", "t", keys(1, 2, 4))
    # "a" goes (least recently used) but its pages are reused, so "b" must go too.
    assert [e.checkpoint_id for e in res.evicted] == ["a", "b"]
    assert set(res.reused_keys) == {key(1), key(2)}
    index.commit("c")
    assert index.longest_prefix(keys(1, 2, 4), "t") == 3


def test_an_eviction_names_the_pages_it_freed_and_not_those_still_shared() -> None:
    index = RAMIndex(num_slots=5, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(1, 2, 3))
    stored(index, "b", "t", keys(1, 2, 4))  # shares pages 1 and 2 with "a"
    (gone,) = index.reserve("c", "t", keys(5, 6)).evicted
    assert gone.checkpoint_id == "a"
    assert gone.freed == (key(3),)  # "b" still holds 1 and 2
    assert index.absent(keys(1, 2, 3)) == gone.freed
    index.commit("c")
    (gone,) = index.reserve("d", "t", keys(7, 8, 9)).evicted
    assert gone.checkpoint_id == "b"
    assert gone.freed == tuple(keys(1, 2, 4))  # their last holder went
    assert index.absent(keys(1, 2, 4)) == gone.freed


def test_absent_keeps_order_drops_repeats_sees_every_tenant_and_changes_nothing() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    stored(index, "a", "t", keys(1))
    stored(index, "b", "u", keys(2, tag=1))
    before = (index.stats(), index.entries())
    assert index.absent(keys(9, 1, 3, 9)) == tuple(keys(9, 3))
    assert index.absent([key(2, tag=1), key(2)]) == (key(2),)  # held under "u": not absent
    assert index.absent(iter(keys(1, 4))) == (key(4),)
    assert index.absent([]) == ()
    assert (index.stats(), index.entries()) == before


def test_max_bytes_below_the_pool_caps_the_capacity() -> None:
    index = RAMIndex(num_slots=10, slot_bytes=SLOT, max_entries=10, max_bytes=3 * SLOT + 5)
    assert index.capacity_bytes == 3 * SLOT
    stored(index, "a", "t", keys(1, 2, 3))
    res = index.reserve("b", "t", keys(4))
    assert [e.checkpoint_id for e in res.evicted] == ["a"]


def test_pinned_pages_are_never_evicted() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(1, 2))
    stored(index, "b", "t", keys(3, 4))
    index.pin(keys(1), "t")
    index.pin(keys(3, 4), "t")
    # "a" and "b" hold pinned pages: "a" is least recently touched but neither may go.
    before = (index.stats(), ids(index))
    with pytest.raises(DoesNotFitError) as err:
        index.reserve("c", "t", keys(5))
    assert err.value.bound == "max_bytes"
    assert (index.stats(), ids(index)) == before

    index.unpin(keys(3, 4))
    res = index.reserve("c", "t", keys(5, 6))
    assert [e.checkpoint_id for e in res.evicted] == ["b"]
    assert index.longest_prefix(keys(1, 2), "t") == 2


def test_a_pending_store_is_never_evicted() -> None:
    index = RAMIndex(num_slots=2, slot_bytes=SLOT, max_entries=10)
    index.reserve("a", "t", keys(1, 2))
    with pytest.raises(DoesNotFitError):
        index.reserve("b", "t", keys(3))
    index.commit("a")
    assert [e.checkpoint_id for e in index.reserve("b", "t", keys(3)).evicted] == ["a"]


def test_a_checkpoint_sharing_a_page_still_being_written_is_not_evicted() -> None:
    index = RAMIndex(num_slots=3, slot_bytes=SLOT, max_entries=2)
    index.reserve("a", "t", keys(1))
    stored(index, "b", "t", keys(1, 2))
    with pytest.raises(DoesNotFitError) as err:
        index.reserve("c", "t", keys(3))
    assert err.value.bound == "max_entries"
    index.commit("a")
    assert [e.checkpoint_id for e in index.reserve("c", "t", keys(3)).evicted] == ["a"]


def test_a_checkpoint_larger_than_the_tier_does_not_fit_and_changes_nothing() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    stored(index, "a", "t", keys(1))
    before = (index.stats(), index.entries())
    with pytest.raises(DoesNotFitError) as err:
        index.reserve("big", "t", keys(*range(10, 15)))
    assert err.value.bound == "max_bytes"
    assert "320" in str(err.value) and "256" in str(err.value)
    assert (index.stats(), index.entries()) == before


def test_max_entries_holds() -> None:
    index = RAMIndex(num_slots=100, slot_bytes=SLOT, max_entries=2)
    for i in range(5):
        stored(index, f"c{i}", "t", keys(i))
        assert index.stats().entries <= 2
    assert ids(index) == ["c3", "c4"]


def test_pages_become_loadable_at_commit_only() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    index.reserve("a", "t", keys(1, 2))
    assert index.longest_prefix(keys(1, 2), "t") == 0
    with pytest.raises(PageNotFoundError):
        index.pin(keys(1), "t")
    entry = index.get("a", "t")
    assert entry.pending and not entry.complete
    index.commit("a")
    assert index.longest_prefix(keys(1, 2), "t") == 2
    assert index.get("a", "t").complete


def test_abort_frees_only_the_pages_it_brought() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    stored(index, "a", "t", keys(1, 2))
    index.reserve("b", "t", keys(1, 2, 3))
    index.abort("b")
    assert ids(index) == ["a"]
    assert index.stats().pages == 2
    assert index.longest_prefix(keys(1, 2), "t") == 2
    with pytest.raises(CheckpointNotFoundError):
        index.get("b", "t")


def test_a_page_whose_writer_aborted_is_copied_by_the_next_reservation() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    first = index.reserve("a", "t", keys(1, 2))
    second = index.reserve("b", "t", keys(1, 3))
    assert dict(zip(second.reused_keys, second.reused_slots)) == {key(1): first.slots[0]}
    assert list(second.new_keys) == keys(3)
    index.commit("b")
    assert not index.get("b", "t").complete

    index.abort("a")
    assert index.stats().pages == 2  # page 1 is still referenced by "b"
    assert index.longest_prefix(keys(1, 3), "t") == 0
    third = index.reserve("c", "t", keys(1))
    assert (third.new_keys, third.new_slots) == ((key(1),), (first.slots[0],))
    index.commit("c")
    assert index.get("b", "t").complete
    assert index.longest_prefix(keys(1, 3), "t") == 2


def test_remove_while_a_load_is_in_flight_frees_the_page_at_unpin() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    stored(index, "a", "t", keys(1, 2))
    slots = index.pin(keys(1), "t")
    index.remove("a", "t")
    assert index.stats().pages == 1
    assert index.stats().pinned_pages == 1
    assert index.longest_prefix(keys(1), "t") == 1
    # The pinned slot is not handed out while the load runs.
    res = index.reserve("b", "t", keys(5, 6, 7))
    assert slots[0] not in res.slots
    index.commit("b")
    index.unpin(keys(1))
    assert index.stats().pages == 3
    assert index.longest_prefix(keys(1), "t") == 0


def test_state_errors() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    index.reserve("a", "t", keys(1))
    with pytest.raises(CheckpointExistsError):
        index.reserve("a", "t", keys(2))
    with pytest.raises(CheckpointBusyError):
        index.remove("a", "t")
    index.commit("a")
    with pytest.raises(CheckpointBusyError):
        index.commit("a")
    with pytest.raises(CheckpointBusyError):
        index.abort("a")
    with pytest.raises(CheckpointExistsError):
        index.reserve("a", "t", keys(2))
    with pytest.raises(CheckpointNotFoundError):
        index.remove("nope", "t")
    with pytest.raises(KeyError):
        index.commit("nope")
    with pytest.raises(ValueError, match="unpin"):
        index.unpin(keys(1))
    index.pin(keys(1), "t")
    with pytest.raises(ValueError, match="unpin"):
        index.unpin(keys(1, 1))
    index.unpin(keys(1))
    assert index.stats().pinned_pages == 0


def test_pin_fails_closed_on_a_missing_page_and_pins_nothing() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    stored(index, "a", "t", keys(1))
    with pytest.raises(PageNotFoundError):
        index.pin(keys(1, 2), "t")
    assert index.stats().pinned_pages == 0


def test_tenant_isolation_at_pin_get_and_lookup() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    stored(index, "a", "alice", keys(1, 2))
    stored(index, "m", "mallory", keys(1, 2, tag=9))

    with pytest.raises(TenantMismatchError) as err:
        index.get("a", "mallory")
    assert "alice" not in str(err.value)
    with pytest.raises(TenantMismatchError):
        index.pin(keys(1, 2), "mallory")
    with pytest.raises(TenantMismatchError):
        # Even a load mixing own and foreign pages is refused as a whole.
        index.pin([key(1, 9), key(1)], "mallory")
    assert index.stats().pinned_pages == 0
    with pytest.raises(TenantMismatchError):
        index.remove("a", "mallory")
    assert index.longest_prefix(keys(1, 2), "mallory") == 0
    assert index.longest_prefix(keys(1, 2), "alice") == 2
    assert ids(index, "alice") == ["a"]
    assert ids(index, "mallory") == ["m"]
    assert index.get("a", "alice").tenant == "alice"


def test_a_key_held_under_another_tenant_is_refused_at_reserve() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    stored(index, "a", "alice", keys(1, 2))
    before = (index.stats(), index.entries())
    with pytest.raises(TenantMismatchError):
        index.reserve("m", "mallory", keys(3, 1))
    assert (index.stats(), index.entries()) == before


def test_the_tenant_quota_evicts_only_the_tenants_own_checkpoints() -> None:
    index = RAMIndex(num_slots=16, slot_bytes=SLOT, max_entries=16, tenant_quota_bytes=3 * SLOT)
    stored(index, "x", "bob", keys(1, 2, 3, tag=1))
    stored(index, "a", "alice", keys(1, 2))
    res = index.reserve("b", "alice", keys(3, 4))
    assert [e.checkpoint_id for e in res.evicted] == ["a"]
    index.commit("b")
    stats = index.stats()
    assert stats.tenant_bytes == {"bob": 3 * SLOT, "alice": 2 * SLOT}
    assert stats.tenant_quota_bytes == 3 * SLOT

    with pytest.raises(DoesNotFitError) as err:
        index.reserve("big", "alice", keys(*range(10, 14)))
    assert err.value.bound == "tenant_quota_bytes"

    index.pin(keys(3, 4), "alice")
    with pytest.raises(DoesNotFitError) as err:
        index.reserve("c", "alice", keys(5, 6))
    assert err.value.bound == "tenant_quota_bytes"
    assert ids(index) == ["x", "b"]


def test_longest_prefix_changes_nothing() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    stored(index, "a", "t", keys(1, 2))
    stored(index, "b", "t", keys(3))
    before = (index.stats(), index.entries())
    for _ in range(3):
        assert index.longest_prefix(keys(1, 2, 4, 3), "t") == 2
    assert (index.stats(), index.entries()) == before


def test_meta_is_recorded_and_snapshots_are_read_only() -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    index.reserve("a", "t", keys(1), meta={"trigger": "system"})
    index.commit("a")
    index.set_meta("a", refusal="residency")
    entry = index.get("a", "t")
    assert dict(entry.meta) == {"trigger": "system", "refusal": "residency"}
    with pytest.raises(TypeError):
        entry.meta["trigger"] = "user"  # type: ignore[index]
    with pytest.raises(CheckpointNotFoundError):
        index.set_meta("nope", x=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"slot_bytes": 0}, ValueError, "slot_bytes"),
        ({"slot_bytes": -1}, ValueError, "slot_bytes"),
        ({"slot_bytes": 1.5}, TypeError, "slot_bytes"),
        ({"num_slots": 0}, ValueError, "num_slots"),
        ({"num_slots": True}, TypeError, "num_slots"),
        ({"max_entries": 0}, ValueError, "max_entries"),
        ({"max_bytes": SLOT - 1}, ValueError, "max_bytes"),
        ({"max_bytes": 0}, ValueError, "max_bytes"),
        ({"tenant_quota_bytes": SLOT - 1}, ValueError, "tenant_quota_bytes"),
    ],
)
def test_bad_construction_is_refused(kwargs: dict, error: type, field: str) -> None:
    args = {"num_slots": 4, "slot_bytes": SLOT, "max_entries": 4, **kwargs}
    with pytest.raises(error, match=field):
        RAMIndex(**args)


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda i: i.reserve("a", "t", [b"short"]), ValueError, "16 bytes"),
        (lambda i: i.reserve("a", "t", ["0" * 16]), TypeError, "bytes"),
        (lambda i: i.reserve("a", "t", [bytearray(16)]), TypeError, "bytes"),
        (lambda i: i.reserve("a", "t", key(1)), TypeError, "sequence"),
        (lambda i: i.reserve("a", "t", []), ValueError, "keys"),
        (lambda i: i.reserve("a", "", keys(1)), ValueError, "tenant"),
        (lambda i: i.reserve("a", None, keys(1)), TypeError, "tenant"),
        (lambda i: i.reserve("", "t", keys(1)), ValueError, "checkpoint_id"),
        (lambda i: i.reserve(7, "t", keys(1)), TypeError, "checkpoint_id"),
        (lambda i: i.reserve("a", "t", keys(1), meta=[1]), TypeError, "meta"),
        (lambda i: i.longest_prefix([b"x" * 17], "t"), ValueError, "16 bytes"),
        (lambda i: i.absent([b"x" * 17]), ValueError, "16 bytes"),
        (lambda i: i.absent(key(1)), TypeError, "sequence"),
        (lambda i: i.pin(keys(1), ""), ValueError, "tenant"),
        (lambda i: i.get("a", ""), ValueError, "tenant"),
    ],
)
def test_bad_input_is_refused(call, error: type, field: str) -> None:
    index = RAMIndex(num_slots=4, slot_bytes=SLOT, max_entries=4)
    with pytest.raises(error, match=field):
        call(index)
    assert index.stats().entries == 0


def test_a_large_tiers_trim_leaves_its_slack_free_for_the_next_stores() -> None:
    assert (slack(2**18 - 1), slack(2**18), slack(10**6)) == (0, 64, 244)
    n = 2**18
    index = RAMIndex(num_slots=n, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(*range(n - 1000)))
    stored(index, "b", "t", keys(*range(1000), tag=1))
    # 20 pages wanted: "a" (least recent) loses 20 and the tier's slack, 64, of its tail.
    (gone,) = index.reserve("c", "t", keys(*range(20), tag=2)).evicted
    assert (gone.checkpoint_id, gone.trimmed) == ("a", True)
    assert gone.freed == tuple(keys(*range(n - 1084, n - 1000)))
    index.commit("c")
    # The next stores fit in what the slack left: no plan, nothing evicted.
    assert index.reserve("d", "t", keys(*range(40), tag=3)).evicted == ()
    assert index.reserve("e", "t", keys(*range(24), tag=4)).evicted == ()
    assert index.stats().pages == n


def test_a_trim_that_would_keep_no_page_evicts_its_checkpoint_whole() -> None:
    n = 2**18
    index = RAMIndex(num_slots=n, slot_bytes=SLOT, max_entries=10)
    stored(index, "a", "t", keys(*range(50)))
    stored(index, "b", "t", keys(*range(n - 50), tag=1))
    # 20 wanted, "a" frees 50: within the slack, so it leaves whole rather than empty.
    (gone,) = index.reserve("c", "t", keys(*range(20), tag=2)).evicted
    assert (gone.checkpoint_id, gone.trimmed, len(gone.freed)) == ("a", False, 50)
    assert ids(index) == ["b", "c"]
