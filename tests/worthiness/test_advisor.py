from __future__ import annotations

import logging
import math

import pytest

from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointRecommendation,
    CheckpointSignal,
    CheckpointTier,
    DiskPromotionRule,
    ModelSelfReport,
    SignalKind,
    default_registry,
)

from .fixed_scorers import FixedScorer, RaisingScorer, registry_of

EMPTY = CheckpointObservation()

# Everything the default set reads, measured and favourable: the default advisor says disk.
WORTHY = CheckpointObservation(
    context_tokens=30_000,
    wall_time_s=4.0,
    tool_calls=3,
    retrievals=2,
    sibling_tasks=3,
    queued_tasks=1,
    retrieved_items=20,
    novel_items=1,
    evidence_spans=12,
    claims=8,
    contradictions_unresolved=0,
    contradictions_high_severity=0,
    context_rewrites=0,
    context_evictions=0,
    turns_since_change=6,
    phase="understand",
    phase_completed=True,
    self_report=ModelSelfReport(understood=True, confidence=0.9),
)


def disk_ready(**overrides: float | None) -> list[FixedScorer]:
    """Scorers named like the three the disk rule reads, all clearing its bar by default."""
    values = {"rebuild_cost": 0.9, "predicted_reuse": 0.9, "context_stability": 0.9, **overrides}
    return [FixedScorer(name, 1.0, value) for name, value in values.items()]


def test_the_aggregate_is_the_weighted_mean_of_the_answers_only() -> None:
    advisor = CheckpointAdvisor(
        registry_of(
            FixedScorer("a", 3.0, 0.8), FixedScorer("b", 1.0, 0.4), FixedScorer("silent", 5.0, None)
        )
    )
    recommendation = advisor.recommend(EMPTY)
    assert recommendation.score == pytest.approx((3.0 * 0.8 + 1.0 * 0.4) / 4.0)
    assert recommendation.abstained == ("silent",)
    assert recommendation.weights == {"a": 3.0, "b": 1.0, "silent": 5.0}


def test_a_zero_weight_answer_is_recorded_but_does_not_move_the_aggregate() -> None:
    advisor = CheckpointAdvisor(
        registry_of(FixedScorer("a", 1.0, 0.8), FixedScorer("zero", 0.0, 0.0))
    )
    recommendation = advisor.recommend(EMPTY)
    assert recommendation.score == pytest.approx(0.8)
    assert recommendation.abstained == ()
    assert [signal.name for signal in recommendation.signals] == ["a", "zero"]


def test_a_veto_forces_none_whatever_the_aggregate() -> None:
    advisor = CheckpointAdvisor(
        registry_of(*disk_ready(), FixedScorer("gate", 0.0, None, veto=True))
    )
    recommendation = advisor.recommend(EMPTY)
    assert recommendation.score == pytest.approx(0.9)
    assert recommendation.tier is CheckpointTier.NONE
    assert recommendation.vetoed_by == ("gate",)
    assert recommendation.blockers[0] == "vetoed by gate: fixed at None"


def test_the_contradictions_scorer_vetoes_a_worthy_context() -> None:
    advisor = CheckpointAdvisor()
    assert advisor.recommend(WORTHY).tier is CheckpointTier.DISK
    contested = WORTHY.model_copy(
        update={"contradictions_unresolved": 1, "contradictions_high_severity": 1}
    )
    recommendation = advisor.recommend(contested)
    assert recommendation.tier is CheckpointTier.NONE
    assert recommendation.vetoed_by == ("contradictions",)
    assert recommendation.score is not None and recommendation.score > advisor.disk_threshold - 0.15


def test_the_self_report_alone_never_recommends() -> None:
    advisor = CheckpointAdvisor()
    alone = advisor.recommend(CheckpointObservation(self_report=ModelSelfReport(understood=True)))
    assert alone.score == 1.0
    assert alone.tier is CheckpointTier.NONE
    assert any("model_self_report is the only evidence" in blocker for blocker in alone.blockers)
    # With any other evidence, the self-report is one signal among others.
    # A scorer with weight 0 answering too is no extra evidence.
    registry = default_registry()
    registry.register(FixedScorer("informational", 0.0, 1.0))
    still_alone = CheckpointAdvisor(registry).recommend(
        CheckpointObservation(self_report=ModelSelfReport(understood=True))
    )
    assert still_alone.tier is CheckpointTier.NONE
    backed = advisor.recommend(
        CheckpointObservation(context_tokens=60_000, self_report=ModelSelfReport(understood=True))
    )
    assert backed.tier is CheckpointTier.RAM
    assert not any("only evidence" in blocker for blocker in backed.blockers)


def test_a_raising_scorer_is_a_loud_abstention(caplog: pytest.LogCaptureFixture) -> None:
    healthy = registry_of(FixedScorer("a", 1.0, 0.6))
    with_flaky = registry_of(FixedScorer("a", 1.0, 0.6), RaisingScorer())
    with caplog.at_level(logging.WARNING, logger="kvci_plugin.worthiness"):
        recommendation = CheckpointAdvisor(with_flaky).recommend(EMPTY)
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "flaky" in warnings[0].getMessage()
    assert "RuntimeError" in warnings[0].getMessage()
    assert "backend unreachable" in warnings[0].getMessage()
    assert recommendation.abstained == ("flaky",)
    assert [(e.name, e.error_type, e.message) for e in recommendation.scorer_errors] == [
        ("flaky", "RuntimeError", "backend unreachable")
    ]
    # Never a silent zero: the aggregate is what it is without the failed scorer.
    assert (
        recommendation.score
        == CheckpointAdvisor(healthy).recommend(EMPTY).score
        == pytest.approx(0.6)
    )


def test_a_scorer_returning_the_wrong_thing_is_a_scorer_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class WrongType:
        name = "wrong_type"
        weight = 1.0

        def score(self, observation: CheckpointObservation) -> object:
            return 0.9

    class WrongName:
        name = "wrong_name"
        weight = 1.0

        def score(self, observation: CheckpointObservation) -> CheckpointSignal:
            return CheckpointSignal(name="other", kind=SignalKind.RISK, value=0.9, reason="")

    class OutOfRange:
        name = "out_of_range"
        weight = 1.0

        def score(self, observation: CheckpointObservation) -> CheckpointSignal:
            return CheckpointSignal(name="out_of_range", kind=SignalKind.RISK, value=1.5, reason="")

    with caplog.at_level(logging.WARNING, logger="kvci_plugin.worthiness"):
        recommendation = CheckpointAdvisor(
            registry_of(WrongType(), WrongName(), OutOfRange())
        ).recommend(EMPTY)
    assert {e.name: e.error_type for e in recommendation.scorer_errors} == {
        "wrong_type": "TypeError",
        "wrong_name": "ValueError",
        "out_of_range": "ValidationError",
    }
    assert recommendation.score is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3


def test_no_live_weight_recommends_nothing_and_says_why() -> None:
    for registry in (
        default_registry(),  # every default scorer abstains on an empty observation
        registry_of(FixedScorer("a", 0.0, 0.9), FixedScorer("b", 0.0, 1.0)),
        registry_of(),
    ):
        recommendation = CheckpointAdvisor(registry).recommend(EMPTY)
        assert recommendation.score is None
        assert recommendation.tier is CheckpointTier.NONE
        assert (
            recommendation.blockers[0] == "no evidence: no scorer with a positive weight answered"
        )


@pytest.mark.parametrize(
    ("score", "tier"),
    [
        (0.2, CheckpointTier.NONE),
        (0.549, CheckpointTier.NONE),
        (0.55, CheckpointTier.RAM),
        (0.74, CheckpointTier.RAM),
        (0.75, CheckpointTier.DISK),
    ],
)
def test_the_thresholds_pick_the_tier(score: float, tier: CheckpointTier) -> None:
    # The three disk requirements pass at 0.9 with weight 0; "s" alone sets the aggregate.
    scorers = [FixedScorer(s.name, 0.0, s.value) for s in disk_ready()]
    recommendation = CheckpointAdvisor(
        registry_of(*scorers, FixedScorer("s", 1.0, score))
    ).recommend(EMPTY)
    assert recommendation.tier is tier
    assert recommendation.worth_it is (tier is not CheckpointTier.NONE)


def test_thresholds_are_configurable() -> None:
    registry = registry_of(
        *[FixedScorer(s.name, 0.0, s.value) for s in disk_ready()], FixedScorer("s", 1.0, 0.5)
    )
    assert CheckpointAdvisor(registry).recommend(EMPTY).tier is CheckpointTier.NONE
    assert (
        CheckpointAdvisor(registry, ram_threshold=0.4).recommend(EMPTY).tier is CheckpointTier.RAM
    )
    assert (
        CheckpointAdvisor(registry, ram_threshold=0.4, disk_threshold=0.5).recommend(EMPTY).tier
        is CheckpointTier.DISK
    )
    rule = DiskPromotionRule(aggregate_floor=0.45)
    assert CheckpointAdvisor(registry, ram_threshold=0.4, disk_rule=rule).disk_threshold == 0.45


@pytest.mark.parametrize(
    ("requirement", "failing", "expected"),
    [
        ("rebuild_cost", 0.5, "disk not recommended — rebuild_cost 0.50 below 0.60 (fixed at 0.5)"),
        (
            "predicted_reuse",
            0.25,
            "disk not recommended — predicted_reuse 0.25 below 0.50 (fixed at 0.25)",
        ),
        (
            "context_stability",
            0.1,
            "disk not recommended — context_stability 0.10 below 0.60 (fixed at 0.1)",
        ),
        ("rebuild_cost", None, "disk not recommended — rebuild_cost: abstained (fixed at None)"),
        (
            "predicted_reuse",
            None,
            "disk not recommended — predicted_reuse: abstained (fixed at None)",
        ),
        (
            "context_stability",
            None,
            "disk not recommended — context_stability: abstained (fixed at None)",
        ),
    ],
)
def test_each_disk_requirement_blocks_disk_and_names_itself(
    requirement: str, failing: float | None, expected: str
) -> None:
    scorers = [FixedScorer(s.name, 0.0, s.value) for s in disk_ready(**{requirement: failing})]
    recommendation = CheckpointAdvisor(
        registry_of(*scorers, FixedScorer("s", 1.0, 0.95))
    ).recommend(EMPTY)
    assert recommendation.tier is CheckpointTier.RAM
    assert recommendation.blockers == (expected,)


def test_an_unregistered_requirement_fails_and_the_floor_is_a_requirement() -> None:
    registry = default_registry()
    registry.unregister("context_stability")
    recommendation = CheckpointAdvisor(registry).recommend(WORTHY)
    assert recommendation.tier is CheckpointTier.RAM
    assert recommendation.blockers == ("disk not recommended — context_stability: not registered",)
    low = CheckpointAdvisor(registry_of(*disk_ready(), FixedScorer("low", 1.0, 0.0))).recommend(
        EMPTY
    )
    assert low.score == pytest.approx(0.675)
    assert low.tier is CheckpointTier.RAM
    assert low.blockers == ("disk not recommended — score 0.68 below the disk floor 0.75",)


def test_blockers_give_every_reason_a_higher_tier_was_not_recommended() -> None:
    scorers = [
        FixedScorer(s.name, 1.0, s.value)
        for s in disk_ready(predicted_reuse=None, context_stability=0.0)
    ]
    recommendation = CheckpointAdvisor(
        registry_of(*scorers, FixedScorer("low", 4.0, 0.0))
    ).recommend(EMPTY)
    assert recommendation.tier is CheckpointTier.NONE
    assert recommendation.blockers == (
        "ram not recommended — score 0.15 below the ram threshold 0.55",
        "disk not recommended — predicted_reuse: abstained (fixed at None)",
        "disk not recommended — context_stability 0.00 below 0.60 (fixed at 0.0)",
        "disk not recommended — score 0.15 below the disk floor 0.75",
    )


def test_drivers_are_the_top_contributions_with_their_reasons() -> None:
    advisor = CheckpointAdvisor(
        registry_of(
            FixedScorer("small", 0.1, 1.0),
            FixedScorer("big", 1.0, 0.9),
            FixedScorer("zero_value", 2.0, 0.0),
            FixedScorer("middle", 0.5, 0.8),
            FixedScorer("silent", 9.0, None),
            FixedScorer("weightless", 0.0, 1.0),
        ),
        max_drivers=3,
    )
    drivers = advisor.recommend(EMPTY).drivers
    assert [(d.name, d.value, d.weight) for d in drivers] == [
        ("big", 0.9, 1.0),
        ("middle", 0.8, 0.5),
        ("small", 1.0, 0.1),
    ]
    advisor.max_drivers = 10
    assert [d.name for d in advisor.recommend(EMPTY).drivers] == [
        "big",
        "middle",
        "small",
        "zero_value",
    ]
    assert drivers[0].reason == "fixed at 0.9"
    assert drivers[0].kind is SignalKind.OPPORTUNITY
    assert (
        CheckpointAdvisor(default_registry(), max_drivers=1).recommend(WORTHY).drivers[0].name
        == "rebuild_cost"
    )


def test_the_recommendation_round_trips_through_json(caplog: pytest.LogCaptureFixture) -> None:
    registry = default_registry()
    registry.register(RaisingScorer())
    recommendation = CheckpointAdvisor(registry).recommend(WORTHY)
    assert recommendation.scorer_errors and recommendation.drivers and recommendation.signals
    restored = CheckpointRecommendation.model_validate_json(recommendation.model_dump_json())
    assert restored == recommendation
    assert restored.tier is CheckpointTier.DISK


def test_the_default_advisor_on_an_engine_only_observation() -> None:
    # What the engine alone measures for a plain request: size and prefill time.
    advisor = CheckpointAdvisor()
    assert (
        advisor.recommend(CheckpointObservation(context_tokens=512, wall_time_s=0.05)).tier
        is CheckpointTier.NONE
    )
    long = advisor.recommend(CheckpointObservation(context_tokens=32_768, wall_time_s=3.0))
    assert long.tier is CheckpointTier.RAM
    assert (
        "disk not recommended — predicted_reuse: abstained (no sibling, queued or observed reuse "
        "counts)"
        in long.blockers
    )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"disk_threshold": 0.8, "disk_rule": DiskPromotionRule()}, ValueError),
        ({"ram_threshold": 0.9}, ValueError),
        ({"ram_threshold": 0.0}, ValueError),
        ({"ram_threshold": math.nan}, ValueError),
        ({"ram_threshold": "0.5"}, TypeError),
        ({"disk_threshold": 1.5}, ValueError),
        ({"max_drivers": -1}, ValueError),
    ],
)
def test_bad_advisor_settings_are_refused(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        CheckpointAdvisor(**kwargs)  # type: ignore[arg-type]


def test_recommend_needs_an_observation() -> None:
    with pytest.raises(TypeError, match="CheckpointObservation"):
        CheckpointAdvisor().recommend({"context_tokens": 1})  # type: ignore[arg-type]
