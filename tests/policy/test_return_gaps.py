"""The learned return gap: per class, a quantile of observed pauses, bounded, cheap, forgetful."""

from __future__ import annotations

import pytest

from kvci_plugin.policy.return_gaps import (
    END_OF_TURN,
    TOOL_CALL,
    Gap,
    ReturnGaps,
    gap_class,
)


def learn(gaps: ReturnGaps, cls: str, seconds: list[float], start: float = 0.0) -> float:
    """One session per gap: finished at ``now``, back ``seconds`` later."""
    now = start
    for n, gap in enumerate(seconds):
        gaps.finished(f"s{n}", cls, now)
        assert gaps.arrived(f"s{n}", now + gap) == Gap(cls, gap)
        now += gap + 1.0
    return now


def test_the_class_follows_the_word_on_the_turns_end() -> None:
    assert gap_class(True) == TOOL_CALL
    assert gap_class(False) == END_OF_TURN
    assert gap_class(None) is None


def test_the_ttl_is_the_classes_quantile_of_observed_gaps() -> None:
    gaps = ReturnGaps(quantile=0.9, min_samples=10)
    learn(gaps, TOOL_CALL, [float(s) for s in range(1, 101)])  # 1 .. 100 s
    learn(gaps, END_OF_TURN, [1000.0 + s for s in range(20)])
    assert gaps.ttl(TOOL_CALL, 300.0) == 90.0
    assert gaps.ttl(END_OF_TURN, 5000.0) == 1017.0  # each class learns its own
    assert gaps.samples(TOOL_CALL) == 100 and gaps.samples(END_OF_TURN) == 20


def test_the_ttl_is_bounded_by_max_retain_s_and_zero_turns_it_off() -> None:
    gaps = ReturnGaps(quantile=0.9, min_samples=1)
    learn(gaps, TOOL_CALL, [500.0] * 5)
    assert gaps.ttl(TOOL_CALL, 300.0) == 300.0
    assert gaps.ttl(TOOL_CALL, 0.0) == 0.0


def test_the_prior_stands_until_a_class_has_enough_gaps() -> None:
    gaps = ReturnGaps(quantile=0.5, min_samples=4, prior_s=42.0)
    learn(gaps, TOOL_CALL, [5.0, 5.0, 5.0])
    assert gaps.ttl(TOOL_CALL, 300.0) == 42.0
    assert gaps.ttl(TOOL_CALL, 10.0) == 10.0  # the prior is bounded too
    learn(gaps, TOOL_CALL, [5.0], start=100.0)
    assert gaps.ttl(TOOL_CALL, 300.0) == 5.0


def test_the_window_forgets_old_gaps() -> None:
    gaps = ReturnGaps(quantile=1.0, window=8, min_samples=1)
    learn(gaps, TOOL_CALL, [100.0] * 8)
    assert gaps.ttl(TOOL_CALL, 300.0) == 100.0
    learn(gaps, TOOL_CALL, [10.0] * 8, start=2000.0)  # the workload sped up
    assert gaps.ttl(TOOL_CALL, 300.0) == 10.0
    assert gaps.samples(TOOL_CALL) == 8


def test_only_a_known_turn_end_opens_a_gap_and_a_gap_closes_once() -> None:
    gaps = ReturnGaps()
    gaps.finished("a", None, 0.0)
    assert gaps.arrived("a", 5.0) is None
    assert gaps.arrived("never-finished", 5.0) is None
    gaps.finished("a", TOOL_CALL, 10.0)
    gaps.finished("a", None, 12.0)  # a later turn of unknown end replaces it
    assert gaps.arrived("a", 20.0) is None
    gaps.finished("b", TOOL_CALL, 10.0)
    assert gaps.arrived("b", 16.0) == Gap(TOOL_CALL, 6.0)
    assert gaps.arrived("b", 30.0) is None  # closed: the next request opened nothing
    assert gaps.open_sessions == 0


def test_the_sessions_remembered_are_bounded() -> None:
    gaps = ReturnGaps(max_sessions=2)
    for n, session in enumerate(("a", "b", "c")):
        gaps.finished(session, TOOL_CALL, float(n))
    assert gaps.open_sessions == 2
    assert gaps.arrived("a", 10.0) is None  # the least recently finished was forgotten
    assert gaps.arrived("c", 10.0) == Gap(TOOL_CALL, 8.0)


def test_a_clock_going_back_learns_no_negative_gap() -> None:
    gaps = ReturnGaps()
    gaps.finished("a", TOOL_CALL, 10.0)
    assert gaps.arrived("a", 9.0) == Gap(TOOL_CALL, 0.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"quantile": 0.0}, {"quantile": 1.5}, {"window": 0}, {"min_samples": 0},
     {"window": 4, "min_samples": 5}, {"prior_s": -1.0}, {"max_sessions": True}],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ReturnGaps(**kwargs)


def test_an_unknown_class_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown return-gap class"):
        ReturnGaps().finished("a", "lunch", 0.0)
