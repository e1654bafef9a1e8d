"""The page table's column kernels, each checked against the same work done one page at a time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.ops._native import (
    add_pages,
    held_conflict,
    loadable_run,
    pin_pages,
    ref_pages,
    release_pages,
    take_pages,
    unpin_pages,
    write_pages,
    written_pages,
)

N = 12
NO_WRITER = -1
READY = 1
ERASED = 2

small = st.integers(0, 3)
columns = st.fixed_dictionaries({
    "refs": st.lists(small, min_size=N, max_size=N),
    "pins": st.lists(small, min_size=N, max_size=N),
    "writer": st.lists(st.sampled_from([NO_WRITER, 5, 6]), min_size=N, max_size=N),
    "state": st.lists(st.sampled_from([0, READY, 2, 3]), min_size=N, max_size=N),
    "tenant": st.lists(st.integers(0, 1), min_size=N, max_size=N),
    "released": st.lists(small, min_size=N, max_size=N),
    "kept": st.lists(st.booleans(), min_size=N, max_size=N),
})
slot_lists = st.lists(st.integers(0, N - 1), max_size=2 * N)
distinct_slots = st.lists(st.integers(0, N - 1), max_size=N, unique=True)


def arrays(cols: dict) -> dict[str, np.ndarray]:
    kinds = {"state": np.int8, "kept": bool}
    return {name: np.array(v, kinds.get(name, np.int64)) for name, v in cols.items()}


@settings(max_examples=200, deadline=None)
@given(cols=columns, found=st.lists(st.integers(-1, N - 1), max_size=N), tenant=st.integers(0, 1))
def test_loadable_run_stops_at_the_first_page_not_held_ready_and_the_tenants(cols, found,
                                                                              tenant) -> None:
    a = arrays(cols)
    want = 0
    for s in found:
        if s < 0 or a["state"][s] != READY or a["tenant"][s] != tenant:
            break
        want += 1
    assert loadable_run(np.array(found, np.int64), a["state"], READY, a["tenant"],
                        tenant) == want


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=slot_lists)
def test_pins_count_first_pins_and_unpins_undo_them_or_change_nothing(cols, slots) -> None:
    a = arrays(cols)
    idx = np.array(slots, np.int64)
    pins = a["pins"].copy()
    first = busy = 0
    for s in slots:  # one at a time: a slot named twice is pinned twice
        if pins[s] == 0:
            first += 1
            busy += a["writer"][s] == NO_WRITER
        pins[s] += 1
    assert pin_pages(idx, a["pins"], a["writer"], NO_WRITER) == (first, busy)
    assert a["pins"].tolist() == pins.tolist()
    # Unpinning what was pinned brings every count back.
    before = np.array(cols["pins"], np.int64)
    unused, last, idle = unpin_pages(idx, a["pins"], a["writer"], a["refs"], NO_WRITER)
    assert a["pins"].tolist() == before.tolist()
    went = {s for s in slots if before[s] == 0}  # pinned only by this load
    assert last == len(went)
    assert idle == sum(a["writer"][s] == NO_WRITER for s in went)
    assert sorted(np.frombuffer(unused, np.int64).tolist()) == sorted(
        s for s in went if a["writer"][s] == NO_WRITER and a["refs"][s] == 0)


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=slot_lists)
def test_an_unpin_past_the_pins_changes_nothing(cols, slots) -> None:
    a = arrays(cols)
    named = np.bincount(np.array(slots, np.int64), minlength=N)
    result = unpin_pages(np.array(slots, np.int64), a["pins"], a["writer"], a["refs"], NO_WRITER)
    if (named > np.array(cols["pins"])).any():
        assert result is None and a["pins"].tolist() == cols["pins"]
    else:
        assert result is not None
        assert a["pins"].tolist() == (np.array(cols["pins"]) - named).tolist()


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=slot_lists, wide=st.booleans())
def test_ref_adds_a_reference_to_each_slot_named(cols, slots, wide) -> None:
    a = arrays(cols)
    want = np.array(cols["refs"], np.int64) + np.bincount(np.array(slots, np.int64),
                                                          minlength=N)
    assert ref_pages(np.array(slots, np.int64 if wide else np.int32), a["refs"]) is None
    assert a["refs"].tolist() == want.tolist()
    with pytest.raises(ValueError, match="outside"):
        ref_pages(np.array([0, N], np.int64), a["refs"])
    assert a["refs"].tolist() == want.tolist()  # checked before anything changed


@settings(max_examples=100, deadline=None)
@given(cols=columns, slots=distinct_slots, wide=st.booleans(), tenant=st.integers(0, 3),
       pool=st.integers(0, 3))
def test_add_makes_each_slot_a_new_page_of_one_reference_not_ready_with_no_writer(
        cols, slots, wide, tenant, pool) -> None:
    a = arrays(cols)
    a["pool"] = a["tenant"].copy()
    before = {name: a[name].copy() for name in ("refs", "pins", "state", "writer", "tenant",
                                                 "pool")}
    idx = np.array(slots, np.int64 if wide else np.int32)
    assert add_pages(idx, a["refs"], a["pins"], a["state"], a["writer"], a["tenant"], a["pool"],
                     tenant, pool, NO_WRITER) is None
    want = {"refs": 1, "pins": 0, "state": 0, "writer": NO_WRITER, "tenant": tenant,
            "pool": pool}
    others = np.setdiff1d(np.arange(N), np.array(slots, np.int64))
    for name, value in want.items():
        assert a[name][idx].tolist() == [value] * len(slots), name
        assert a[name][others].tolist() == before[name][others].tolist(), name
    with pytest.raises(ValueError, match="outside"):
        add_pages(np.array([0, N], np.int64), a["refs"], a["pins"], a["state"], a["writer"],
                  a["tenant"], a["pool"], tenant, pool, NO_WRITER)
    with pytest.raises(ValueError, match="as long as the table"):
        add_pages(idx, a["refs"][:-1], a["pins"], a["state"], a["writer"], a["tenant"],
                  a["pool"], tenant, pool, NO_WRITER)


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=distinct_slots, wide=st.booleans(), plan=st.sampled_from([1, 2, 3]),
       earlier=st.lists(st.sampled_from([1, 2, 3]), min_size=N, max_size=N),
       kept_by=st.lists(st.sampled_from([0, 1, 2, 3]), min_size=N, max_size=N),
       quiet=st.booleans())
def test_take_counts_a_holder_taken_by_the_plan_and_names_the_pages_all_of_whose_holders_are_taken(
        cols, slots, wide, plan, earlier, kept_by, quiet) -> None:
    a = arrays(cols)
    if quiet:  # no page pinned or being written: every holder can be taken
        a["pins"][:] = 0
        a["writer"][:] = NO_WRITER
    # What plans wrote before: a count under another plan's number is not this plan's.
    taken = (np.array(earlier, np.int64) << 32) | a["released"]
    kept = np.array(kept_by, np.int32)
    idx = np.array(slots, np.int64 if wide else np.int32)
    counts = np.where(np.array(earlier)[idx] == plan, a["released"][idx], 0) + 1
    want = np.flatnonzero((counts == a["refs"][idx]) & (kept[idx] != plan)).tolist()
    before = taken.copy()
    got = take_pages(idx, taken, a["refs"], kept, plan, a["pins"], a["writer"], NO_WRITER)
    if any(a["pins"][s] != 0 or a["writer"][s] != NO_WRITER for s in slots):
        # A page pinned or being written keeps its holder: nothing is counted.
        assert got is None
        assert taken.tolist() == before.tolist()
    else:
        assert np.frombuffer(got, np.int64).tolist() == want
        assert (taken[idx] >> 32).tolist() == [plan] * len(slots)
        assert (taken[idx] & 0xFFFFFFFF).tolist() == counts.tolist()
    with pytest.raises(ValueError, match="plan must be"):
        take_pages(idx, taken, a["refs"], kept, 0, a["pins"], a["writer"], NO_WRITER)
    with pytest.raises(TypeError, match="kept must be a C-contiguous int32"):
        take_pages(idx, taken, a["refs"], kept.astype(bool), plan, a["pins"], a["writer"],
                   NO_WRITER)


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=distinct_slots, writer=st.sampled_from([5, 6]))
def test_release_drops_a_reference_and_its_writers_copies(cols, slots, writer) -> None:
    a = arrays(cols)
    a["refs"] += 1  # a checkpoint holding these pages references each
    idx = np.array(slots, np.int32)
    refs = a["refs"][idx] - 1
    mine = a["writer"][idx] == writer
    idle = int((mine & (a["pins"][idx] == 0)).sum())
    writers = np.where(mine, NO_WRITER, a["writer"][idx])
    want = idx[(refs == 0) & (a["pins"][idx] == 0) & (writers == NO_WRITER)]
    unused, counts, busy = release_pages((idx,), (writer,), a["refs"], a["pins"], a["writer"],
                                         NO_WRITER)
    assert (np.frombuffer(unused, np.int64).tolist(), busy) == (want.tolist(), idle)
    assert np.frombuffer(counts, np.int64).tolist() == [len(want)]
    assert a["refs"][idx].tolist() == refs.tolist()
    assert a["writer"][idx].tolist() == writers.tolist()


@settings(max_examples=200, deadline=None)
@given(cols=columns, holders=st.lists(distinct_slots, max_size=4),
       writers=st.lists(st.sampled_from([5, 6, 7]), min_size=4, max_size=4))
def test_holders_released_in_one_call_free_what_one_call_each_frees(cols, holders,
                                                                    writers) -> None:
    a = arrays(cols)
    a["refs"] += 4  # enough references for every holder to let go of its pages
    one = {name: column.copy() for name, column in a.items()}
    each, counts, busy = [], [], 0
    for slots, writer in zip(holders, writers):
        unused, n, idle = release_pages((np.array(slots, np.int64),), (writer,), one["refs"],
                                        one["pins"], one["writer"], NO_WRITER)
        each += np.frombuffer(unused, np.int64).tolist()
        counts += np.frombuffer(n, np.int64).tolist()
        busy += idle
    unused, n, idle = release_pages([np.array(s, np.int32) for s in holders],
                                    writers[:len(holders)], a["refs"], a["pins"], a["writer"],
                                    NO_WRITER)
    assert np.frombuffer(unused, np.int64).tolist() == each
    assert np.frombuffer(n, np.int64).tolist() == counts
    assert idle == busy
    assert a["refs"].tolist() == one["refs"].tolist()
    assert a["writer"].tolist() == one["writer"].tolist()
    # Checked whole first: a slot out of range in any holder changes nothing.
    refs = a["refs"].copy()
    with pytest.raises(ValueError, match="outside"):
        release_pages([np.array([0], np.int64), np.array([N], np.int64)], [5, 6], a["refs"],
                      a["pins"], a["writer"], NO_WRITER)
    assert a["refs"].tolist() == refs.tolist()
    with pytest.raises(ValueError, match="one writer number a holder"):
        release_pages([np.array([0], np.int64)], [], a["refs"], a["pins"], a["writer"],
                      NO_WRITER)


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=distinct_slots, tenant=st.integers(0, 1))
def test_held_conflict_names_the_first_page_of_another_tenant_or_being_erased(
        cols, slots, tenant) -> None:
    a = arrays(cols)
    want = -1
    for i, s in enumerate(slots):
        if a["tenant"][s] != tenant or a["state"][s] & ERASED:
            want = 2 * i + (a["tenant"][s] == tenant)
            break
    assert held_conflict(np.array(slots, np.int64), a["tenant"], tenant, a["state"],
                         ERASED) == want


@settings(max_examples=200, deadline=None)
@given(cols=columns, slots=distinct_slots, writer=st.sampled_from([5, 7]))
def test_a_writer_takes_the_pages_no_one_copies_and_makes_them_ready(cols, slots,
                                                                    writer) -> None:
    a = arrays(cols)
    idx = np.array(slots, np.int64)
    take = ((a["state"][idx] & READY) == 0) & (a["writer"][idx] == NO_WRITER)
    busy = int((take & (a["pins"][idx] == 0)).sum())
    writers = np.where(take, writer, a["writer"][idx])
    mine, got = write_pages(idx, a["state"], READY, a["writer"], writer, NO_WRITER, a["pins"])
    assert (np.frombuffer(mine, bool).tolist(), got) == ((writers == writer).tolist(), busy)
    assert a["writer"][idx].tolist() == writers.tolist()
    ready = a["state"][idx] | np.where(writers == writer, READY, 0)
    idle = int(((writers == writer) & (a["pins"][idx] == 0)).sum())
    assert written_pages(idx, a["state"], READY, a["writer"], writer, NO_WRITER,
                         a["pins"]) == idle
    assert a["state"][idx].tolist() == ready.tolist()
    assert writer not in a["writer"][idx].tolist()


def test_slots_and_columns_are_checked_before_anything_changes() -> None:
    refs, pins = np.zeros(4, np.int64), np.zeros(4, np.int64)
    writer = np.full(4, NO_WRITER, np.int64)
    with pytest.raises(ValueError, match=r"slots\[1\] = 4 is outside \[0, 4\)"):
        pin_pages(np.array([0, 4], np.int64), pins, writer, NO_WRITER)
    assert pins.tolist() == [0, 0, 0, 0]
    with pytest.raises(TypeError, match="int64 or int32"):
        pin_pages(np.array([0], np.int16), pins, writer, NO_WRITER)
    with pytest.raises(TypeError, match="pins must be a C-contiguous int64"):
        pin_pages(np.array([0], np.int64), pins.astype(np.int32), writer, NO_WRITER)
    with pytest.raises(ValueError, match="as long as"):
        pin_pages(np.array([0], np.int64), pins, writer[:3], NO_WRITER)
    with pytest.raises(ValueError, match="contiguous"):
        pin_pages(np.array([0], np.int64), pins[::-1], writer, NO_WRITER)
    frozen = pins.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        pin_pages(np.array([0], np.int64), frozen, writer, NO_WRITER)
    with pytest.raises(ValueError, match=r"found\[0\] = 9"):
        loadable_run(np.array([9], np.int64), np.zeros(4, np.int8), READY, refs, 0)
