"""PressureAwareAdmission: the RAM bar rises with wasted writes and falls with missed reuses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from worthiness.fixed_scorers import FixedScorer

from kvci_plugin.policy.admission import PressureAwareAdmission
from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointRecommendation,
    CheckpointScorerRegistry,
    CheckpointTier,
)

OBS = CheckpointObservation()


def advisor_scoring(value: float, *, veto: bool = False) -> CheckpointAdvisor:
    registry = CheckpointScorerRegistry([FixedScorer("evidence", 1.0, value, veto=veto)])
    return CheckpointAdvisor(registry)


def scored(value: float, bar: float = 0.55, *, veto: bool = False) -> CheckpointRecommendation:
    return advisor_scoring(value, veto=veto).recommend(OBS, ram_threshold=bar)


def rule(capacity_bytes: int = 1_000, **settings: float) -> PressureAwareAdmission[str]:
    return PressureAwareAdmission.for_advisor(
        CheckpointAdvisor(), capacity_bytes=capacity_bytes, **settings
    )


def test_it_starts_at_the_advisors_ram_threshold_bounded_by_its_disk_threshold() -> None:
    bar = rule()
    assert bar.threshold == 0.55 and bar.max_threshold == 0.75 and bar.min_threshold == 0.30
    for n in range(40):
        bar.admitted(f"a{n}")
        bar.evicted([f"a{n}"])
    assert bar.threshold == pytest.approx(0.75)
    assert bar.stats().wasted_writes == 40


def test_an_admitted_checkpoint_evicted_before_a_hit_raises_the_bar_and_one_hit_first_does_not() -> None:  # noqa: E501
    bar = rule()
    bar.admitted("a")
    bar.admitted("b")
    bar.observe_lookup(["root", "b", "new"], resident=2)  # a later turn hits b
    bar.evicted(["x", "b"])
    assert bar.threshold == 0.55
    bar.evicted(["a"])
    assert bar.threshold == pytest.approx(0.56)
    bar.evicted(["a"])  # told twice: one mistake
    stats = bar.stats()
    assert (stats.wasted_writes, stats.paid_writes, stats.tracked_admitted) == (1, 1, 0)


def test_a_lookup_extending_a_held_back_checkpoint_lowers_the_bar_once_per_request() -> None:
    bar = rule()
    bar.declined("t1", 100, scored(0.5))
    bar.declined("t2", 100, scored(0.5))
    bar.observe_lookup(["root", "t1", "t2", "t3"], resident=1)
    assert bar.threshold == pytest.approx(0.54)
    assert bar.stats().missed_reuses == 1 and bar.stats().tracked_held_back == 0
    bar.observe_lookup(["root", "t1", "t2", "t3"], resident=1)  # remembered once: counted once
    assert bar.threshold == pytest.approx(0.54)


def test_a_held_back_checkpoint_already_resident_was_not_missed() -> None:
    bar = rule()
    bar.declined("t1", 100, scored(0.5))
    bar.observe_lookup(["root", "t1", "t2"], resident=2)
    assert bar.threshold == 0.55 and bar.stats().missed_reuses == 0


@pytest.mark.parametrize(
    ("recommendation", "why"),
    [
        (scored(0.6), "recommended: the bar did not hold it back"),
        (scored(0.1, veto=True), "vetoed: no bar admits it"),
        (scored(0.2), "below the lowest bar"),
    ],
)
def test_only_what_the_bar_alone_held_back_is_remembered(
    recommendation: CheckpointRecommendation, why: str
) -> None:
    bar = rule()
    bar.declined("t1", 100, recommendation)
    bar.observe_lookup(["root", "t1", "t2"], resident=1)
    assert bar.threshold == 0.55, why


def test_held_back_checkpoints_are_forgotten_once_later_ones_fill_the_tiers_capacity() -> None:
    bar = rule(capacity_bytes=250)
    for name in ("old", "mid", "new"):
        bar.declined(name, 100, scored(0.5))
    assert bar.stats().tracked_held_back == 2
    bar.observe_lookup(["old", "x"], resident=0)  # too late: the tier could not have kept it
    assert bar.threshold == 0.55
    bar.observe_lookup(["mid", "x"], resident=0)
    assert bar.threshold == pytest.approx(0.54)


def test_the_bar_it_sets_is_what_the_advisor_scores_with() -> None:
    advisor = advisor_scoring(0.5)
    bar = PressureAwareAdmission[str].for_advisor(advisor, capacity_bytes=10_000)
    for turn in range(5):
        recommendation = advisor.recommend(OBS, ram_threshold=bar.threshold)
        assert recommendation.tier is CheckpointTier.NONE
        bar.declined(f"t{turn}", 100, recommendation)
        bar.observe_lookup(["root", f"t{turn}", "next"], resident=1)
    assert bar.threshold == pytest.approx(0.50)
    assert advisor.recommend(OBS, ram_threshold=bar.threshold).tier is CheckpointTier.RAM


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"capacity_bytes": 0}, ValueError, "capacity_bytes must be >= 1"),
        ({"capacity_bytes": 1.5}, TypeError, "capacity_bytes must be an int"),
        ({"min_threshold": 0.6}, ValueError, "min_threshold <= initial_threshold"),
        ({"step": 0.0}, ValueError, "step must be in"),
        ({"step": float("inf")}, ValueError, "step must be in"),
        ({"max_tracked": True}, TypeError, "max_tracked must be an int"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(
    settings: dict[str, object], error: type, message: str
) -> None:
    arguments: dict[str, object] = {"capacity_bytes": 1_000, **settings}
    with pytest.raises(error, match=message):
        rule(**arguments)  # type: ignore[arg-type]


def test_bad_calls_are_refused_naming_the_field() -> None:
    bar = rule()
    with pytest.raises(ValueError, match="resident must be an int in \\[0, 2\\]"):
        bar.observe_lookup(["a", "b"], resident=3)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        bar.declined("a", -1, scored(0.5))
    with pytest.raises(TypeError, match="recommendation must be a CheckpointRecommendation"):
        bar.declined("a", 1, {"score": 0.5})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="advisor must be a CheckpointAdvisor"):
        PressureAwareAdmission.for_advisor(object(), capacity_bytes=1)  # type: ignore[arg-type]


events = st.lists(
    st.tuples(
        st.sampled_from(["admit", "decline", "lookup", "evict"]),
        st.integers(0, 5),
        st.integers(0, 3),
    ),
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(events=events)
def test_the_bar_moves_one_step_per_counted_mistake_and_stays_within_its_bounds(
    events: list[tuple[str, int, int]],
) -> None:
    bar = rule(capacity_bytes=300, step=0.05)
    held = scored(0.4)
    unclamped = 0.55
    for kind, key, resident in events:
        before = bar.stats()
        if kind == "admit":
            bar.admitted(f"k{key}")
        elif kind == "decline":
            bar.declined(f"k{key}", 100, held)
        elif kind == "lookup":
            keys = [f"k{n}" for n in range(key, key + 3)]
            bar.observe_lookup(keys, resident=resident)
        else:
            bar.evicted([f"k{key}"])
        after = bar.stats()
        wasted = after.wasted_writes - before.wasted_writes
        missed = after.missed_reuses - before.missed_reuses
        assert missed <= 1
        unclamped = min(0.75, max(0.30, unclamped + 0.05 * wasted - 0.05 * missed))
        assert bar.threshold == pytest.approx(unclamped)
        assert 0.30 <= bar.threshold <= 0.75
        assert after.tracked_held_back <= 3
