"""The reuse hazard's sums: every class's open idle periods summed in one pass, and the same
figures in every process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.policy.anchor_table import IdleAges
from kvci_plugin.policy.reuse_hazard import EDGES, ReuseHazard, idle_exposure

AGES = st.floats(0.0, 2.0 * EDGES[-1], allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(periods=st.lists(st.tuples(st.integers(0, 6), AGES), max_size=200))
def test_one_pass_over_every_group_sums_each_group_as_it_alone_would(periods) -> None:
    """Bit for bit: the refresh's figures may not move by a last bit (policy_sim's decisions are
    compared key by key before and after a change)."""
    groups = np.array([g for g, _ in periods], np.int64)
    ages = np.array([a for _, a in periods], np.float64)
    together = idle_exposure(groups, ages, 7)
    assert together.shape == (7, len(EDGES))
    for g in range(7):
        mine = ages[groups == g]
        alone = idle_exposure(np.zeros(mine.size, np.int64), mine, 1)[0]
        assert together[g].tobytes() == alone.tobytes()


def test_the_anchor_tables_classes_are_summed_apart() -> None:
    """``IdleAges`` numbers each (band, re-sends capped at 2, what was said) class: two anchors of
    different classes never share a row, and re-sends past the cap share one."""
    band = np.array([-1, -1, 3, 0, 0])
    reuses = np.array([0, 0, 1, 2, 9])
    said = np.array([0, 1, 2, 0, 0])
    last_seen = np.array([95.0, 90.0, 50.0, 0.0, 99.0])
    spent = IdleAges(band, reuses, said, last_seen, 100.0).spent()
    assert set(spent) == {(-1, 0, None), (-1, 0, True), (3, 1, False), (0, 2, None)}
    assert spent[(-1, 0, None)].sum() == 5.0 and spent[(-1, 0, True)].sum() == 10.0
    assert spent[(3, 1, False)].sum() == 50.0 and spent[(0, 2, None)].sum() == 101.0


_LEARN = """
import numpy as np
from kvci_plugin.policy.anchor_table import IdleAges
from kvci_plugin.policy.reuse_hazard import ReuseHazard
rng = np.random.default_rng(7)
h = ReuseHazard()
for _ in range(300):
    cls = (int(rng.integers(-1, 4)), int(rng.integers(0, 3)), [None, True, False][rng.integers(3)])
    h.ended(cls, float(rng.exponential(100.0)), reused=bool(rng.random() < 0.3))
n = 5000
h.refresh(IdleAges(rng.integers(-1, 4, n), rng.integers(0, 3, n), rng.integers(0, 3, n),
                   rng.uniform(0.0, 5000.0, n), 6000.0))
print(np.array(h._pooled).tobytes().hex())
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
    from_table.refresh(IdleAges(np.array([0, 0]), np.array([1, 1]), np.array([1, 1]),
                                np.array([10.0, 70.0]), 100.0))
    from_mapping = ReuseHazard()
    from_mapping.refresh({(0, 1, True): [90.0, 30.0]})
    assert from_table._pooled == from_mapping._pooled
    assert from_table._hazards == from_mapping._hazards
