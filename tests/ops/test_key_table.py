"""KeyTable: the RAM tier's page keys -> slots, checked against a dict doing the same."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvci_plugin.ops._native import KeyTable

CAPACITY = 64


def slots(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def found(table: KeyTable, keys: list[bytes]) -> list[int]:
    return np.frombuffer(table.find(keys), np.int64).tolist()


def test_keys_are_found_at_their_slots_and_gone_once_removed() -> None:
    table = KeyTable(8)
    a, b, c = (os.urandom(16) for _ in range(3))
    table.insert([a, b], slots(5, 0))
    assert len(table) == 2
    assert found(table, [b, c, a]) == [0, -1, 5]
    assert table.keys_at(slots(5, 0)) == [a, b]
    assert np.frombuffer(table.held(), np.int64).tolist() == [0, 5]
    table.remove(slots(5))
    assert found(table, [a, b]) == [-1, 0]
    table.insert([a], slots(5))  # a slot and a key may come back
    assert found(table, [a]) == [5]
    table.clear()
    assert len(table) == 0 and found(table, [a, b]) == [-1, -1]


def test_keys_that_are_not_16_byte_bytes_are_refused_by_position() -> None:
    table = KeyTable(4)
    good = os.urandom(16)
    for bad in (b"short", bytearray(16), "x" * 16, 7):
        with pytest.raises(TypeError, match=r"keys\[1\]"):
            table.find([good, bad])
        with pytest.raises(TypeError, match=r"keys\[1\]"):
            KeyTable.check((good, bad))
    assert KeyTable.check((good, good)) == 2
    with pytest.raises(TypeError):
        table.find(5)  # not a sequence


def test_a_refused_insert_or_remove_changes_nothing() -> None:
    table = KeyTable(4)
    a, b, c = (os.urandom(16) for _ in range(3))
    table.insert([a], slots(0))
    for keys, at, why in (([b, a], slots(1, 2), "held already"),
                          ([b], slots(0), "already holds"),
                          ([b, b], slots(1, 2), "repeats"),
                          ([b, c], slots(1, 1), "repeats"),
                          ([b], slots(4), "outside"),
                          ([b, c], slots(1), "2 keys but 1 slots")):
        with pytest.raises(ValueError, match=why):
            table.insert(keys, at)
        assert len(table) == 1 and found(table, [a, b, c]) == [0, -1, -1]
    with pytest.raises(ValueError, match="holds no key"):
        table.remove(slots(0, 3))
    with pytest.raises(ValueError, match="named twice"):
        table.remove(slots(0, 0))
    assert found(table, [a]) == [-1]  # the first removal of a repeated slot went through
    with pytest.raises(TypeError, match="int64"):
        table.remove(np.array([0], np.int32))


@pytest.mark.parametrize("capacity", [0, -1, 2**31])
def test_a_capacity_out_of_range_is_refused(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        KeyTable(capacity)


def test_keys_sharing_their_hash_bucket_survive_removals_in_any_order() -> None:
    # Structured keys (counters) crowd a table that hashed them poorly; removing from the
    # middle of a probe run must leave every other key findable (backward-shift deletion).
    table = KeyTable(4096)
    keys = [i.to_bytes(16, "big") for i in range(4096)]
    table.insert(keys, np.arange(4096, dtype=np.int64))
    gone = np.random.default_rng(0).permutation(4096)[:3000]
    for chunk in np.array_split(gone, 30):
        table.remove(chunk)
    kept = sorted(set(range(4096)) - set(gone.tolist()))
    assert found(table, [keys[i] for i in kept]) == kept
    assert set(found(table, [keys[i] for i in gone])) == {-1}


def test_a_repeated_find_answers_what_the_table_holds_now() -> None:
    """find remembers its last answer for the same key objects: never past a change of the
    table, nor for a list changed in place since."""
    table = KeyTable(8)
    keys = [os.urandom(16) for _ in range(4)]
    table.insert(keys[:3], slots(0, 1, 2))
    chain = tuple(keys)
    assert found(table, chain) == [0, 1, 2, -1]
    assert found(table, chain[:2]) == [0, 1]  # a leading run of the same objects
    table.remove(slots(1))
    assert found(table, chain[:2]) == [0, -1]
    table.insert([keys[3]], slots(7))
    assert found(table, chain) == [0, -1, 2, 7]
    same_bytes = [bytes(k) for k in (keys[2], keys[0])]  # equal keys, other objects
    assert found(table, same_bytes) == [2, 0]
    listed = list(chain)
    assert found(table, listed) == [0, -1, 2, 7]
    listed[0] = keys[2]
    assert found(table, listed) == [2, -1, 2, 7]
    table.clear()
    assert found(table, listed) == [-1, -1, -1, -1]


def test_a_table_grows_with_its_keys_kept() -> None:
    table = KeyTable(2)
    a, b, c = (os.urandom(16) for _ in range(3))
    table.insert([a, b], slots(1, 0))
    with pytest.raises(ValueError, match="outside"):
        table.insert([c], slots(40))
    with pytest.raises(ValueError, match=r"capacity must be in \[2,"):
        table.grow(1)
    table.grow(64)
    table.insert([c], slots(40))
    assert found(table, [a, b, c]) == [1, 0, 40] and len(table) == 3
    assert np.frombuffer(table.held(), np.int64).tolist() == [0, 1, 40]


class KeyTableMachine(RuleBasedStateMachine):
    """Random inserts, removals and finds agree with a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.table = KeyTable(CAPACITY)
        self.capacity = CAPACITY
        self.model: dict[bytes, int] = {}
        self.last: list[bytes] = []  # the keys of the last find
        # A few distinct key bytes, so that keys come back after removal.
        self.pool = [bytes([i]) * 16 for i in range(CAPACITY + 16)]

    @rule(n=st.integers(1, 8), data=st.data())
    def insert(self, n: int, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.pool), min_size=n, max_size=n))
        at = data.draw(st.lists(st.integers(0, self.capacity - 1), min_size=n, max_size=n))
        used = set(self.model.values())
        ok = (len(set(keys)) == n and len(set(at)) == n
              and not any(k in self.model for k in keys) and not used.intersection(at))
        if ok:
            self.table.insert(keys, np.array(at, np.int64))
            self.model.update(zip(keys, at))
        else:
            with pytest.raises(ValueError):
                self.table.insert(keys, np.array(at, np.int64))

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if not self.model:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        self.table.remove(np.array([self.model.pop(k) for k in keys], np.int64))

    @rule(data=st.data())
    def find(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.pool), max_size=20))
        assert found(self.table, keys) == [self.model.get(k, -1) for k in keys]
        assert self.table.find_held(keys) == [(i, self.model[k]) for i, k in enumerate(keys)
                                              if k in self.model]
        self.last = keys

    @rule(data=st.data())
    def find_again(self, data: st.DataObject) -> None:
        """The last find's keys, or a leading run of them (a request's later calls)."""
        keys = self.last[:data.draw(st.integers(0, len(self.last)))]
        assert found(self.table, keys) == [self.model.get(k, -1) for k in keys]
        assert self.table.find_held(keys) == [(i, self.model[k]) for i, k in enumerate(keys)
                                              if k in self.model]

    @rule(more=st.integers(0, 40))
    def grow(self, more: int) -> None:
        self.capacity += more
        self.table.grow(self.capacity)

    @invariant()
    def agrees(self) -> None:
        assert len(self.table) == len(self.model)
        held = sorted(self.model.values())
        assert np.frombuffer(self.table.held(), np.int64).tolist() == held
        by_slot = {s: k for k, s in self.model.items()}
        assert self.table.keys_at(np.array(held, np.int64)) == [by_slot[s] for s in held]


TestKeyTableMachine = KeyTableMachine.TestCase
TestKeyTableMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_distinct_says_whether_a_key_repeats() -> None:
    keys = [i.to_bytes(16, "big") for i in range(600)]
    assert KeyTable.distinct(keys) and KeyTable.distinct([])
    again = keys[582][:8] + keys[582][8:]  # equal bytes, another object
    assert not KeyTable.distinct(keys + [again])
    assert not KeyTable.distinct([keys[3], keys[3]])
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        KeyTable.distinct([keys[0], b"short"])


def test_find_last_from_probes_back_the_keys_another_table_holds_at_slots() -> None:
    pages, anchors = KeyTable(64), KeyTable(8)
    keys = [os.urandom(16) for _ in range(40)]
    at = np.arange(63, 23, -1, dtype=np.int64)  # the pages' slots, not in their order
    pages.insert(keys, at)
    anchors.insert([keys[1], keys[4], keys[30]], slots(5, 2, 6))
    # Back from end, the first found: across the probe's chunks of 16 keys too.
    assert anchors.find_last_from(pages, at, 40) == (30, 6)
    assert anchors.find_last_from(pages, at, 30) == (4, 2)
    assert anchors.find_last_from(pages, at, 4) == (1, 5)
    assert anchors.find_last_from(pages, at, 1) == (-1, -1)
    assert anchors.find_last_from(pages, at, 0) == (-1, -1)
    assert anchors.find_last_from(pages, at[[4, 1, 9]], 3) == (1, 5)  # any slots, any order
    with pytest.raises(ValueError, match="end = 41"):
        anchors.find_last_from(pages, at, 41)
    with pytest.raises(ValueError, match="end = -1"):
        anchors.find_last_from(pages, at, -1)
    with pytest.raises(ValueError, match="slot 1 holds no key"):
        anchors.find_last_from(pages, slots(30, 1), 2)
    with pytest.raises(TypeError):
        anchors.find_last_from([keys[0]], slots(0), 1)


def test_held_keys_read_a_tables_keys_only_when_asked() -> None:
    from kvci_plugin.ops.held_keys import HeldKeys

    table = KeyTable(8)
    keys = [os.urandom(16) for _ in range(4)]
    table.insert(keys, slots(6, 1, 2, 5))
    held = HeldKeys(table, np.array([1, 5, 6], np.int32))
    assert len(held) == 3 and held[0] == keys[1] and held[-1] == keys[0]
    assert held[1:].keys() == (keys[3], keys[0]) and list(held) == [keys[1], keys[3], keys[0]]
