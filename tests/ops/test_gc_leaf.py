"""``untrack_leaf``: a record that refers only to leaves leaves the collector's generations and is
still freed by reference counting; one that refers to a tracked container stays tracked, so a
cycle through it is still collected."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from kvci_plugin.ops._native import untrack_leaf


class _Record:
    __slots__ = ("name", "size", "blob", "slots", "ids", "other", "__weakref__")

    def __init__(self, other: object = None) -> None:
        self.name, self.size, self.blob = "ckpt", 3.5, b"meta"
        self.slots, self.ids, self.other = np.arange(4, dtype=np.int32), {"a": None}, other


def test_a_record_of_leaves_is_untracked_and_still_freed() -> None:
    record = _Record()
    assert gc.is_tracked(record)
    assert untrack_leaf(record) is True
    assert not gc.is_tracked(record)
    assert record.slots.tolist() == [0, 1, 2, 3] and record.ids == {"a": None}
    gone = weakref.ref(record)
    del record
    assert gone() is None  # reference counting frees it at once, without a collection


def test_a_record_holding_a_tracked_container_stays_tracked_and_its_cycle_is_collected() -> None:
    record = _Record(other=[])
    record.other.append(record)  # a cycle: record -> list -> record
    assert untrack_leaf(record) is False
    assert gc.is_tracked(record)
    gone = weakref.ref(record)
    del record
    gc.collect()
    assert gone() is None


def test_what_the_collector_never_walks_is_left_as_it_is() -> None:
    assert untrack_leaf(7) is False and untrack_leaf(b"bytes") is False
    record = _Record()
    assert untrack_leaf(record) is True
    assert untrack_leaf(record) is False  # already untracked
    tracked = {"k": [1]}
    assert untrack_leaf(tracked) is False and gc.is_tracked(tracked)
