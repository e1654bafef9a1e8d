"""IdsByKey against a dict of lists (the model); the collector never walking it or an
``untracked`` container."""

from __future__ import annotations

import gc
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.ops.quiet import IdsByKey, untracked

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.sampled_from("abcde")),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_ids_by_key_keeps_each_keys_ids_in_the_order_added(ops) -> None:
    ids, model = IdsByKey(), {}
    for add, key, id_ in ops:
        held = model.setdefault(key, [])
        if add and id_ not in held:
            ids.add(key, id_)
            held.append(id_)
        elif not add:
            ids.discard(key, id_)
            if id_ in held:
                held.remove(id_)
        if not held:
            del model[key]
        for k in range(4):
            assert ids.get(k) == tuple(model.get(k, ()))
            assert (k in ids) == (k in model)
        assert len(ids) == len(model)
        assert list(ids.found_in([3, 0, 9, 1])) == [tuple(model[k]) for k in (3, 0, 1)
                                                   if k in model]
    ids.clear()
    assert len(ids) == 0 and ids.get(0) == ()


def test_the_collector_stops_walking_it_and_nothing_stored_tracks_it_again() -> None:
    ids = IdsByKey()
    for slot in range(100):
        ids.add(slot, f"c{slot}")
    ids.add(7, "again")  # a key under several ids holds a tuple of them
    ids.add(7, "and again")
    ids.discard(7, "again")
    gc.collect()  # a full collection untracks a dict of atoms
    inner = ids._ids  # noqa: SLF001 - what the collector would walk
    assert not gc.is_tracked(inner)
    ids.add(8, "more")
    ids.add(101, "new")
    ids.discard(8, "c8")
    assert not gc.is_tracked(inner)
    assert ids.get(7) == ("c7", "and again") and ids.get(8) == ("more",)


def test_an_untracked_container_of_atoms_stays_untracked() -> None:
    order, ids = untracked(OrderedDict()), untracked(set())
    for i in range(100):
        order[f"c{i}"] = i
        ids.add(f"c{i}")
    order.move_to_end("c3")
    del order["c4"]
    assert not gc.is_tracked(order) and not gc.is_tracked(ids)
    assert list(order)[-1] == "c3" and len(order) == 99
