"""AnchorTable: which of a prompt's keys are remembered anchors, probed in one call."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.policy.anchor_table import AnchorTable


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120),
       probe=st.lists(st.integers(0, 40), max_size=30))
def test_a_prompt_finds_the_anchors_remembered_now(ops, probe) -> None:
    """Anchors added and dropped in any order, past the table's first capacity: a probe finds
    exactly the positions whose key is remembered, as a dict of them says."""
    table = AnchorTable(capacity=4)
    rows: dict[bytes, int] = {}
    for add, n in ops:
        if add and key(n) not in rows:
            rows[key(n)] = row = table.add(key(n))
            table.hold(row, n)
        elif not add and key(n) in rows:
            table.drop(rows.pop(key(n)))
    chain = tuple(key(n) for n in probe)
    assert table.remembered_in(chain) == [(i, rows[k], int.from_bytes(k, "big"))
                                          for i, k in enumerate(chain) if k in rows]
    assert len(table) == len(rows)


def test_an_anchor_that_is_not_a_page_key_is_remembered_but_never_in_a_prompt() -> None:
    table = AnchorTable(capacity=2)
    stage = table.add(("kvci", "window stage"))
    short = table.add(b"a")
    page = table.add(key(7))
    table.hold(page, "page")
    assert len({stage, short, page}) == 3
    assert table.remembered_in((key(1), key(7))) == [(1, page, "page")]
    table.drop(stage)
    table.drop(page)
    assert table.remembered_in((key(7),)) == []
    again = table.add(key(9))  # a dropped row comes back with its new key only, a ghost
    assert table.remembered_in((key(7), key(9))) == [(1, again, None)] and again in (stage, page)


def test_many_anchors_grow_the_table_and_stay_found() -> None:
    table = AnchorTable(capacity=8)
    keys = [key(n) for n in range(5000)]
    rows = [table.add(k) for k in keys]
    sample = random.Random(3).sample(range(5000), 300)
    chain = tuple(keys[i] for i in sample) + (key(10**6),)
    assert table.remembered_in(chain) == [(i, rows[n], None) for i, n in enumerate(sample)]


def test_a_checkpoints_held_pages_are_probed_as_its_keys_are() -> None:
    import numpy as np

    from kvci_plugin.ops._native import KeyTable
    from kvci_plugin.ops.held_keys import HeldKeys

    table = AnchorTable(capacity=4)
    rows = {n: table.add(key(n)) for n in (2, 5, 9)}
    pages = KeyTable(32)
    chain = [key(n) for n in range(12)]
    pages.insert(chain, np.arange(31, 19, -1, dtype=np.int64))
    held = HeldKeys(pages, np.arange(31, 19, -1))
    assert table.remembered_in(tuple(chain)) == [(n, rows[n], None) for n in (2, 5, 9)]
    for end, last in ((12, 9), (9, 5), (6, 5), (5, 2), (2, None)):
        want = None if last is None else (last, rows[last], None)
        assert table.last_remembered(held, end) == table.last_remembered(tuple(chain), end) == want
    table.hold(rows[5], "held")
    assert table.last_remembered(held, 9) == (5, rows[5], "held")


def test_a_rows_fields_come_back_as_they_were_put() -> None:
    table = AnchorTable(capacity=2)
    rows = [table.add(key(n)) for n in range(5)]  # grown past its first capacity
    table.put(rows[0], 3, 2, True, 12.5, None)
    table.put(rows[4], -1, 0, None, 7.25, 0.004)
    table.put(rows[2], 9, 7, False, 0.0, 0.0)
    assert table.fields(rows[0]) == (3, True, 12.5, None, 2)
    assert table.fields(rows[4]) == (-1, None, 7.25, 0.004, 0)
    assert table.fields(rows[2]) == (9, False, 0.0, 0.0, 7)
    assert all(type(v) in (int, float, bool, type(None)) for v in table.fields(rows[4]))
