"""LoadOrRecompute: a disk hit is loaded unless this engine's own rates say recomputing it is
clearly faster; unmeasured rates never decline a hit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.tiering.load_or_recompute import LOAD_PREFERENCE, LoadOrRecompute

MB = 1 << 20


def test_an_unmeasured_rate_loads() -> None:
    rule = LoadOrRecompute()
    assert rule.judge(4096, 512 * MB).load
    rule.observe_load(100 * MB, 1.0)  # loads measured, prefill not
    verdict = rule.judge(4096, 512 * MB)
    assert verdict.load and verdict.recompute_s is None and verdict.load_s == pytest.approx(5.12)
    fresh = LoadOrRecompute()
    fresh.observe_prefill(1000, 0.01)  # prefill measured, loads not
    assert fresh.judge(4096, 512 * MB).load


def test_a_hit_is_declined_only_when_recompute_is_clearly_faster() -> None:
    rule = LoadOrRecompute()
    rule.observe_load(100 * MB, 1.0)  # 100 MB/s
    rule.observe_prefill(1000, 1.0)  # 1 ms a token
    # 100 MB load = 1 s; 1000 tokens recompute = 1 s: load.
    assert rule.judge(1000, 100 * MB).load
    # 0.5 s of recompute against a 1 s load: still within the preference for loading.
    assert rule.judge(500, 100 * MB).load
    declined = rule.judge(400, 100 * MB)  # 0.4 s: clearly faster to recompute
    assert not declined.load
    assert declined.load_s == pytest.approx(1.0) and declined.recompute_s == pytest.approx(0.4)


def test_the_median_of_the_window_decides() -> None:
    rule = LoadOrRecompute(window=3)
    rule.observe_prefill(1000, 1.0)
    for seconds in (100.0, 1.0, 1.0):  # one stalled load among fast ones
        rule.observe_load(100 * MB, seconds)
    assert rule.judge(1000, 100 * MB).load_s == pytest.approx(1.0)
    for _ in range(3):  # the window forgets the old rate
        rule.observe_load(100 * MB, 10.0)
    assert not rule.judge(1000, 100 * MB).load


def test_after_declines_in_a_row_one_hit_is_loaded_to_measure_the_rate_again() -> None:
    rule = LoadOrRecompute(window=2, probe_every=4)
    rule.observe_prefill(1000, 1.0)
    for _ in range(2):
        rule.observe_load(100 * MB, 100.0)  # cold, or while a dependency was failing
    assert [rule.judge(1000, 100 * MB).load for _ in range(8)] == [False, False, False, True] * 2
    for _ in range(2):  # what the probes measured: the disk is fast again
        rule.observe_load(100 * MB, 1.0)
    assert all(rule.judge(1000, 100 * MB).load for _ in range(8))


def test_empty_or_instant_measurements_say_nothing() -> None:
    rule = LoadOrRecompute()
    rule.observe_load(0, 1.0)
    rule.observe_load(MB, 0.0)
    rule.observe_prefill(0, 1.0)
    rule.observe_prefill(10, 0.0)
    verdict = rule.judge(1, 1 << 40)
    assert verdict.load and verdict.load_s is None and verdict.recompute_s is None


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_a_bad_window_or_probe_interval_is_refused(window: object) -> None:
    with pytest.raises(ValueError, match="window"):
        LoadOrRecompute(window=window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe_every"):
        LoadOrRecompute(probe_every=window)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(bps=st.floats(1e3, 1e11), spt=st.floats(1e-6, 1.0), tokens=st.integers(1, 10**6),
       nbytes=st.integers(1, 10**12))
def test_the_verdict_is_the_rates_arithmetic(
    bps: float, spt: float, tokens: int, nbytes: int
) -> None:
    rule = LoadOrRecompute()
    rule.observe_load(10**9, 10**9 / bps)
    rule.observe_prefill(10**6, 10**6 * spt)
    verdict = rule.judge(tokens, nbytes)
    assert verdict.load_s == pytest.approx(nbytes / bps)
    assert verdict.recompute_s == pytest.approx(tokens * spt)
    assert verdict.load == (verdict.load_s <= LOAD_PREFERENCE * verdict.recompute_s)


def test_the_recompute_estimate_is_the_median_prefill_rate_times_the_tokens() -> None:
    rule = LoadOrRecompute(window=3)
    assert rule.recompute_s(1000) is None  # nothing measured is not "free"
    for tokens, seconds in ((100, 0.1), (100, 0.3), (100, 0.2)):
        rule.observe_prefill(tokens, seconds)
    assert rule.recompute_s(1000) == pytest.approx(2.0)
    assert rule.judge(1000, 0).recompute_s == rule.recompute_s(1000)
