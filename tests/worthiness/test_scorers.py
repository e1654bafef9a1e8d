"""The default signal set: pinned points of each documented function, and its abstentions."""

from __future__ import annotations

from typing import Any

import pytest

from kvci_plugin.worthiness import (
    CheckpointObservation,
    CheckpointScorer,
    ModelSelfReport,
    SignalKind,
    default_registry,
)
from kvci_plugin.worthiness.scorers import (
    ContextStabilityScorer,
    ContradictionsScorer,
    GroundingDensityScorer,
    ModelSelfReportScorer,
    PhaseBoundaryScorer,
    PredictedReuseScorer,
    RetrievalSaturationScorer,
)


def value(scorer: CheckpointScorer, **fields: Any) -> float | None:
    signal = scorer.score(CheckpointObservation.model_validate(fields))
    assert signal.name == scorer.name
    return signal.value


def test_the_default_set_and_weights_are_the_seeds() -> None:
    registry = default_registry()
    assert {entry.name: entry.weight for entry in registry.entries()} == {
        "rebuild_cost": 0.30,
        "predicted_reuse": 0.15,
        "retrieval_saturation": 0.15,
        "grounding_density": 0.15,
        "contradictions": 0.15,
        "context_stability": 0.10,
        "phase_boundary": 0.10,
        "model_self_report": 0.05,
    }
    smallest = min(registry.entries(), key=lambda entry: entry.weight)
    assert smallest.name == "model_self_report"


def test_every_default_scorer_abstains_on_an_empty_observation() -> None:
    for entry in default_registry().entries():
        signal = entry.scorer.score(CheckpointObservation())
        assert signal.value is None, entry.name
        assert not signal.veto, entry.name
        assert signal.reason, entry.name


def test_predicted_reuse() -> None:
    scorer = PredictedReuseScorer()
    assert value(scorer, sibling_tasks=0) == 0.0  # measured zero is an answer
    assert value(scorer, sibling_tasks=1, queued_tasks=1) == 0.5
    assert value(scorer, sibling_tasks=6) == 1.0
    # Observed reuse counts without any prediction, and the larger estimate wins.
    assert value(scorer, observed_reuse=3) == 0.75
    assert value(scorer, sibling_tasks=1, observed_reuse=3) == 0.75
    assert value(scorer, sibling_tasks=3, observed_reuse=1) == 0.75


def test_retrieval_saturation() -> None:
    scorer = RetrievalSaturationScorer()
    assert value(scorer, retrieved_items=10, novel_items=0) == pytest.approx(11 / 12)
    assert value(scorer, retrieved_items=10, novel_items=10) == pytest.approx(1 / 12)
    assert value(scorer, retrieved_items=1, novel_items=0) == pytest.approx(
        2 / 3
    )  # the prior holds back 1 item
    assert value(scorer, retrieved_items=0, novel_items=0) is None
    assert value(scorer, retrieved_items=5) is None


def test_grounding_density() -> None:
    scorer = GroundingDensityScorer()
    assert value(scorer, evidence_spans=2, claims=2) == 1.0
    assert value(scorer, evidence_spans=1, claims=2) == 0.5
    assert value(scorer, evidence_spans=0, claims=4) == 0.0
    assert value(scorer, evidence_spans=9, claims=2) == 1.0
    assert value(scorer, evidence_spans=3, claims=0) is None
    assert value(scorer, claims=3) is None


def test_contradictions_score_a_clean_context_one_and_veto_on_high_severity() -> None:
    scorer = ContradictionsScorer()
    clean = scorer.score(
        CheckpointObservation(contradictions_unresolved=0, contradictions_high_severity=0)
    )
    assert (clean.value, clean.veto, clean.kind) == (1.0, False, SignalKind.GATE)
    assert value(scorer, contradictions_unresolved=1) == 0.5
    assert value(scorer, contradictions_unresolved=3, contradictions_high_severity=0) == 0.25
    vetoed = scorer.score(
        CheckpointObservation(contradictions_unresolved=4, contradictions_high_severity=1)
    )
    assert vetoed.veto
    assert vetoed.value == 0.0
    # Only "no high-severity ones" was measured: no veto, and no value either.
    unknown = scorer.score(CheckpointObservation(contradictions_high_severity=0))
    assert (unknown.value, unknown.veto) == (None, False)


def test_context_stability() -> None:
    scorer = ContextStabilityScorer()
    assert value(scorer, context_rewrites=0, context_evictions=0) == 1.0
    assert value(scorer, context_rewrites=1, context_evictions=1) == 0.5
    assert value(scorer, context_evictions=2) == 0.5
    assert value(scorer, turns_since_change=2) == 0.5
    assert value(scorer, turns_since_change=0) == 0.0
    assert value(scorer, context_rewrites=2, turns_since_change=2) == 0.25  # both must hold


def test_phase_boundary() -> None:
    scorer = PhaseBoundaryScorer()
    assert value(scorer, phase="plan", phase_completed=True) == 1.0
    assert value(scorer, phase="Understand", phase_completed=True) == 1.0
    assert value(scorer, phase="execute", phase_completed=True) == 0.7
    assert value(scorer, phase_completed=True) == 0.7
    assert value(scorer, phase="plan", phase_completed=False) == 0.2
    assert value(scorer, phase="plan") is None


def test_model_self_report() -> None:
    scorer = ModelSelfReportScorer()
    assert value(scorer, self_report=ModelSelfReport(understood=True)) == 1.0
    assert value(
        scorer, self_report=ModelSelfReport(understood=True, confidence=0.6)
    ) == pytest.approx(0.8)
    assert value(scorer, self_report=ModelSelfReport(understood=False)) == 0.0
    assert value(scorer, self_report=ModelSelfReport(understood=False, confidence=0.0)) == 0.5


def test_reasons_carry_numbers_not_guesses() -> None:
    signal = ContextStabilityScorer().score(CheckpointObservation(context_rewrites=1))
    assert "evictions not measured" in signal.reason
    assert "1 rewrites" in signal.reason
