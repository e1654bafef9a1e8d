"""resend_probabilities: bit for bit the reuse hazard's integral as Python computes it.

The simulator and the engine must weigh alike: the reference here is the loop the policy ran in
Python before the engine weighed in C, one multiply and one add at a time."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.ops._native import resend_probabilities
from kvci_plugin.policy.reuse_hazard import EDGES, ReuseHazard

B = len(EDGES)


def reference(hazards: list[float], age_s: float, horizon_s: float) -> float:
    end = age_s + horizon_s
    total = 0.0
    for j in range(max(0, bisect.bisect_right(EDGES, age_s) - 1), B):
        lo = EDGES[j]
        if lo >= end:
            break
        hi = EDGES[j + 1] if j + 1 < B else end
        total += hazards[j] * (min(hi, end) - max(lo, age_s))
    return 1.0 - math.exp(-total)


ages = st.one_of(st.sampled_from(EDGES), st.floats(0.0, 2.0e5, allow_nan=False))
rates = st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=B, max_size=B)


@settings(max_examples=300, deadline=None)
@given(table=st.lists(rates, min_size=1, max_size=4), data=st.data(),
       horizon=st.one_of(st.sampled_from(EDGES), st.floats(0.0, 1.0e5, allow_nan=False)))
def test_each_probability_equals_the_python_loop_bit_for_bit(table, data, horizon) -> None:
    n = data.draw(st.integers(0, 12))
    rows = data.draw(st.lists(st.integers(0, len(table) - 1), min_size=n, max_size=n))
    at = data.draw(st.lists(ages, min_size=n, max_size=n))
    got = resend_probabilities(np.array(table, np.float64), rows, at, horizon, np.array(EDGES))
    assert got == [reference(table[r], a, horizon) for r, a in zip(rows, at)]


def test_a_hazard_weighs_unseen_classes_by_all_pooled() -> None:
    hazard = ReuseHazard()
    hazard.ended("seen", 3.0, reused=True)
    hazard.ended("other", 40.0, reused=False)
    hazard.refresh({})
    got = hazard.resend_probabilities(["seen", "never", "other"], [0.5, 2.0, 9.0], 30.0)
    assert got == [reference(hazard.rates("seen"), 0.5, 30.0),
                   reference(hazard.rates(), 2.0, 30.0),
                   reference(hazard.rates("other"), 9.0, 30.0)]
    assert hazard.rates("never") == hazard.rates()
    assert hazard.resend_probability("never", 2.0, 30.0) == got[1]


def test_rows_outside_the_table_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rows\[0\] = 2"):
        resend_probabilities(np.zeros((2, B)), [2], [0.0], 1.0, np.array(EDGES))
    with pytest.raises(ValueError, match="one row of len"):
        resend_probabilities(np.zeros(B + 1), [0], [0.0], 1.0, np.array(EDGES))
    with pytest.raises(ValueError, match="as long"):
        resend_probabilities(np.zeros((1, B)), [0, 0], [0.0], 1.0, np.array(EDGES))
    with pytest.raises(TypeError):
        resend_probabilities(np.zeros((1, B)), [0], ["old"], 1.0, np.array(EDGES))
