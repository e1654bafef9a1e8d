"""The reuse hazard's sums: every class's open idle periods summed in one pass, and the same
figures in every process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.policy.anchor_table import AnchorTable
from kvci_plugin.policy.reuse_hazard import EDGES, ReuseHazard, idle_exposure

AGES = st.floats(0.0, 2.0 * EDGES[-1], allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(periods=st.lists(st.tuples(st.integers(0, 6), AGES), max_size=200))
def test_one_pass_over_every_group_sums_each_group_as_it_alone_would(periods) -> None:
    """Bit for bit: the refresh's figures may not move by a last bit (policy_sim's decisions are
    compared key by key before and after a change)."""
    groups = np.array([g for g, _ in periods], np.int64)
    since = 1e6 - np.array([a for _, a in periods], np.float64)
    together, periods = idle_exposure(groups, since, 1e6, 7)
    assert together.shape == (7, len(EDGES))
    for g in range(7):
        mine = since[groups == g]
        alone, n = idle_exposure(np.zeros(mine.size, np.int64), mine, 1e6, 1)
        assert together[g].tobytes() == alone[0].tobytes()
        assert periods[g] == n[0] == mine.size


def test_an_idle_period_is_counted_from_when_it_began() -> None:
    """Its age is ``now - since`` (one that begins after ``now`` is 0 s old), and its bucket the
    one the edges say; a group outside the table is refused."""
    groups = np.array([0, 0, 1, 1], np.int64)
    spent, periods = idle_exposure(groups, np.array([97.0, 100.0, 90.0, 120.0]), 100.0, 2)
    assert periods.tolist() == [2, 2]
    # 3 s idle: 1 s in [0, 1), 1 s in [1, 2), 1 s in [2, 4); 0 s idle: nothing.
    assert spent[0].tolist()[:4] == [1.0, 1.0, 1.0, 0.0] and spent[0].sum() == 3.0
    assert spent[1].sum() == 10.0 and spent[1][4] == 2.0  # 10 s: 1 + 1 + 2 + 4, and 2 in [8, 16)
    with pytest.raises(ValueError, match="outside"):
        idle_exposure(np.array([2], np.int64), np.array([0.0]), 1.0, 2)
    with pytest.raises(TypeError, match="int64"):
        idle_exposure(np.array([0], np.int32), np.array([0.0]), 1.0, 2)


def table_of(*anchors: tuple[int, int, bool | None, float]) -> AnchorTable:
    """A table of anchors of (band, re-sends, what was said, last seen)."""
    table = AnchorTable(capacity=2)  # grown as rows come
    for n, (band, reuses, said, seen) in enumerate(anchors):
        table.put(table.add(f"anchor-{n}"), band, reuses, said, seen, None)
    return table


def test_the_anchor_tables_classes_are_summed_apart() -> None:
    """Each (band, re-sends capped at 2, what was said) class is summed apart: two anchors of
    different classes never share a row, re-sends past the cap share one, and a dropped anchor's
    row counts for nothing."""
    table = table_of((-1, 0, None, 95.0), (-1, 0, True, 90.0), (3, 1, False, 50.0),
                     (0, 2, None, 0.0), (0, 9, None, 99.0), (2, 0, None, 10.0))
    table.drop(5)
    idle = table.idle(100.0)
    assert len(idle) == 5
    spent = idle.spent()
    assert set(spent) == {(-1, 0, None), (-1, 0, True), (3, 1, False), (0, 2, None)}
    assert spent[(-1, 0, None)].sum() == 5.0 and spent[(-1, 0, True)].sum() == 10.0
    assert spent[(3, 1, False)].sum() == 50.0 and spent[(0, 2, None)].sum() == 101.0
    table.put(5, 3, 1, False, 0.0, None)  # the row handed out again, to a class seen already
    assert table.idle(100.0).spent()[(3, 1, False)].sum() == 150.0


def test_an_ages_bucket_is_the_one_its_edges_say() -> None:
    """The buckets' edges are powers of two, and an age's bucket is read from its exponent:
    checked against a search of the edges, on every edge, next to each, and at random."""
    edges = np.array(EDGES)
    ages = np.concatenate([edges, np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf),
                           np.random.default_rng(3).uniform(0.0, 3.0 * EDGES[-1], 10000),
                           [5e-324, 1e300]])
    ages = ages[ages >= 0.0]
    want = np.searchsorted(edges, ages, side="right") - 1
    for age, bucket in zip(ages.tolist(), want.tolist()):
        spent = idle_exposure(np.zeros(1, np.int64), np.array([-age]), 0.0, 1)[0][0]
        # A period ending in its bucket spent nothing past it, and every bucket before in full.
        assert not spent[bucket + 1:].any(), age
        assert spent[:bucket].tolist() == np.diff(edges)[:bucket].tolist(), age


_LEARN = """
import numpy as np
import pytest
from kvci_plugin.policy.anchor_table import AnchorTable
from kvci_plugin.policy.reuse_hazard import ReuseHazard
rng = np.random.default_rng(7)
h = ReuseHazard()
for _ in range(300):
    cls = (int(rng.integers(-1, 4)), int(rng.integers(0, 3)), [None, True, False][rng.integers(3)])
    h.ended(cls, float(rng.exponential(100.0)), reused=bool(rng.random() < 0.3))
n = 5000
table = AnchorTable()
for i in range(n):
    row = table.add(f"a{i}")
    table.put(row, int(rng.integers(-1, 4)), int(rng.integers(0, 3)),
              [None, True, False][rng.integers(3)], float(rng.uniform(0.0, 5000.0)), None)
h.refresh(table.idle(6000.0))
print(np.array(h.rates()).tobytes().hex())
"""


def test_the_same_learning_weighs_the_same_in_every_process() -> None:
    """A class holds None, whose hash is its address on Python 3.11: a set of classes is in
    another order in each process, and pooled sums in that order differed in their last bits
    from run to run (so could the decisions they weigh)."""
    runs = {subprocess.run([sys.executable, "-c", _LEARN], capture_output=True, text=True,
                           check=True).stdout for _ in range(4)}
    assert len(runs) == 1


def test_a_refresh_counts_the_open_periods_of_a_plain_mapping_too() -> None:
    """A ``Live`` mapping of ages per class (a simulator's, a test's) sums as the table does."""
    from_table = ReuseHazard()
    from_table.refresh(table_of((0, 1, True, 10.0), (0, 1, True, 70.0)).idle(100.0))
    from_mapping = ReuseHazard()
    from_mapping.refresh({(0, 1, True): [90.0, 30.0]})
    assert from_table.rates() == from_mapping.rates()
    assert from_table.rates((0, 1, True)) == from_mapping.rates((0, 1, True))
