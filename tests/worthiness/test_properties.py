"""Properties of the aggregation that must hold for every observation and every weighting."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointScorerRegistry,
    CheckpointTier,
    default_registry,
)
from kvci_plugin.worthiness.scorers import (
    ContextStabilityScorer,
    ContradictionsScorer,
    GroundingDensityScorer,
    PredictedReuseScorer,
    RetrievalSaturationScorer,
)

from .fixed_scorers import FixedScorer
from .strategies import observations

SETTINGS = settings(max_examples=120, deadline=None)
unit = st.floats(min_value=0.0, max_value=1.0)
weights = st.floats(min_value=0.0, max_value=100.0)


def fresh_registry(weight_by_name: dict[str, float] | None = None) -> CheckpointScorerRegistry:
    registry = default_registry()
    for name, weight in (weight_by_name or {}).items():
        registry.set_weight(name, weight)
    return registry


@SETTINGS
@given(observation=observations())
def test_every_signal_and_the_score_stay_in_the_unit_interval(
    observation: CheckpointObservation,
) -> None:
    recommendation = CheckpointAdvisor().recommend(observation)
    for signal in recommendation.signals:
        assert signal.value is None or 0.0 <= signal.value <= 1.0, signal
    assert recommendation.score is None or 0.0 <= recommendation.score <= 1.0
    assert recommendation.scorer_errors == ()


@SETTINGS
@given(observation=observations(), weight=weights, veto=st.booleans())
def test_an_abstention_moves_the_aggregate_neither_down_nor_up(
    observation: CheckpointObservation, weight: float, veto: bool
) -> None:
    base = CheckpointAdvisor().recommend(observation)
    registry = default_registry()
    registry.register(FixedScorer("silent", weight, None))
    with_silent = CheckpointAdvisor(registry).recommend(observation)
    assert with_silent.score == base.score
    assert with_silent.tier is base.tier
    assert with_silent.abstained == (*base.abstained, "silent")


@SETTINGS
@given(observation=observations(), value=st.one_of(st.none(), unit), weight=weights)
def test_a_veto_dominates_any_aggregate(
    observation: CheckpointObservation, value: float | None, weight: float
) -> None:
    registry = default_registry()
    registry.register(FixedScorer("gate", weight, value, veto=True))
    recommendation = CheckpointAdvisor(registry).recommend(observation)
    assert recommendation.tier is CheckpointTier.NONE
    assert "gate" in recommendation.vetoed_by


@SETTINGS
@given(
    observation=observations(),
    weight_by_name=st.fixed_dictionaries({name: weights for name in default_registry().names()}),
    factor=st.floats(min_value=1e-3, max_value=1e3),
)
def test_the_score_is_the_renormalised_weighted_mean(
    observation: CheckpointObservation, weight_by_name: dict[str, float], factor: float
) -> None:
    recommendation = CheckpointAdvisor(fresh_registry(weight_by_name)).recommend(observation)
    live = [
        (weight_by_name[s.name], s.value) for s in recommendation.signals if s.value is not None
    ]
    total = sum(weight for weight, _ in live if weight > 0)
    if total == 0:
        assert recommendation.score is None
        return
    expected = sum(weight * value for weight, value in live if weight > 0) / total
    assert recommendation.score is not None and math.isclose(
        recommendation.score, expected, abs_tol=1e-12
    )
    # Scaling every weight by the same factor changes nothing but rounding.
    scaled = {name: weight * factor for name, weight in weight_by_name.items()}
    # Weights so small that scaling underflows them to 0 are a different registry, not a rescale.
    assume(all(weight == 0 or weight * factor > 1e-300 for weight in weight_by_name.values()))
    rescored = CheckpointAdvisor(fresh_registry(scaled)).recommend(observation)
    assert rescored.score is not None and math.isclose(
        rescored.score, recommendation.score, abs_tol=1e-9
    )


def _monotone(scorer: Any, base: dict[str, int], field: str, step: int, rising: bool) -> None:
    before = scorer.score(CheckpointObservation.model_validate(base)).value
    after = scorer.score(
        CheckpointObservation.model_validate({**base, field: base[field] + step})
    ).value
    if before is None or after is None:
        return
    assert (after >= before) if rising else (after <= before), (field, base, step)


counts = st.integers(0, 1000)
steps = st.integers(1, 1000)


@SETTINGS
@given(
    siblings=counts,
    queued=counts,
    observed=counts,
    step=steps,
    field=st.sampled_from(["sibling_tasks", "queued_tasks", "observed_reuse"]),
)
def test_predicted_reuse_rises_with_every_count(
    siblings: int, queued: int, observed: int, step: int, field: str
) -> None:
    base = {"sibling_tasks": siblings, "queued_tasks": queued, "observed_reuse": observed}
    _monotone(PredictedReuseScorer(), base, field, step, rising=True)


@SETTINGS
@given(retrieved=counts, novel=counts, step=steps)
def test_retrieval_saturation_rises_with_known_items_and_falls_with_novel_ones(
    retrieved: int, novel: int, step: int
) -> None:
    novel = min(novel, retrieved)
    _monotone(
        RetrievalSaturationScorer(),
        {"retrieved_items": retrieved, "novel_items": novel},
        "retrieved_items",
        step,
        rising=True,
    )
    if novel + step <= retrieved:
        _monotone(
            RetrievalSaturationScorer(),
            {"retrieved_items": retrieved, "novel_items": novel},
            "novel_items",
            step,
            rising=False,
        )


@SETTINGS
@given(spans=counts, claims=st.integers(1, 1000), step=steps)
def test_grounding_rises_with_spans_and_falls_with_claims(
    spans: int, claims: int, step: int
) -> None:
    base = {"evidence_spans": spans, "claims": claims}
    _monotone(GroundingDensityScorer(), base, "evidence_spans", step, rising=True)
    _monotone(GroundingDensityScorer(), base, "claims", step, rising=False)


@SETTINGS
@given(unresolved=counts, step=steps)
def test_contradictions_fall_with_unresolved_ones(unresolved: int, step: int) -> None:
    _monotone(
        ContradictionsScorer(),
        {"contradictions_unresolved": unresolved},
        "contradictions_unresolved",
        step,
        rising=False,
    )


@SETTINGS
@given(rewrites=counts, evictions=counts, turns=counts, step=steps)
def test_stability_falls_with_churn_and_rises_with_settled_turns(
    rewrites: int, evictions: int, turns: int, step: int
) -> None:
    base = {
        "context_rewrites": rewrites,
        "context_evictions": evictions,
        "turns_since_change": turns,
    }
    _monotone(ContextStabilityScorer(), base, "context_rewrites", step, rising=False)
    _monotone(ContextStabilityScorer(), base, "context_evictions", step, rising=False)
    _monotone(ContextStabilityScorer(), base, "turns_since_change", step, rising=True)
