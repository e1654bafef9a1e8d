from __future__ import annotations

import math

import pytest

from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointScorer,
    CheckpointScorerRegistry,
    CheckpointSignal,
    SignalKind,
    default_registry,
)

from .fixed_scorers import FixedScorer


class LegalHoldScorer:
    """A deployment-specific scorer: reads its input from extras, no core model edit."""

    name = "legal_hold"
    weight = 0.0

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        hold: object | None = observation.extras.get("legal_hold")
        if hold is None:
            return CheckpointSignal(
                name=self.name, kind=SignalKind.GATE, value=None, reason="no legal-hold flag"
            )
        return CheckpointSignal(
            name=self.name,
            kind=SignalKind.GATE,
            value=0.0 if hold else 1.0,
            reason=f"legal hold {hold}",
            veto=bool(hold),
        )


def test_default_scorers_satisfy_the_protocol() -> None:
    for entry in default_registry().entries():
        assert isinstance(entry.scorer, CheckpointScorer)


def test_register_unregister_replace_by_name() -> None:
    registry = CheckpointScorerRegistry()
    registry.register(FixedScorer("a", 1.0, 0.1))
    registry.register(FixedScorer("b", 1.0, 0.2))
    registry.register(FixedScorer("c", 1.0, 0.3))
    assert registry.names() == ("a", "b", "c")
    old = registry.replace(FixedScorer("b", 2.0, 0.9))
    assert isinstance(old, FixedScorer) and old.value == 0.2
    assert registry.names() == ("a", "b", "c")  # position kept
    assert registry.weight("b") == 2.0
    removed = registry.unregister("a")
    assert isinstance(removed, FixedScorer) and removed.value == 0.1
    assert registry.names() == ("b", "c")
    assert "a" not in registry and "b" in registry and len(registry) == 2


def test_duplicate_names_are_refused() -> None:
    registry = default_registry()
    with pytest.raises(ValueError, match="'phase_boundary' is already registered"):
        registry.register(FixedScorer("phase_boundary", 0.1, 0.5))


def test_unknown_names_are_refused() -> None:
    registry = default_registry()
    with pytest.raises(KeyError, match="nope"):
        registry.unregister("nope")
    with pytest.raises(KeyError, match="nope"):
        registry.replace(FixedScorer("nope", 0.1, 0.5))
    with pytest.raises(KeyError, match="nope"):
        registry.set_weight("nope", 0.1)


@pytest.mark.parametrize(
    ("weight", "error"),
    [
        (-0.1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (True, TypeError),
        ("1", TypeError),
    ],
)
def test_weights_must_be_finite_and_non_negative(weight: object, error: type[Exception]) -> None:
    registry = default_registry()
    with pytest.raises(error, match="weight"):
        registry.register(FixedScorer("x", 0.1, 0.5), weight=weight)  # type: ignore[arg-type]
    with pytest.raises(error, match="weight"):
        registry.register(FixedScorer("y", weight, 0.5))  # type: ignore[arg-type]
    with pytest.raises(error, match="weight"):
        registry.set_weight("rebuild_cost", weight)  # type: ignore[arg-type]
    assert registry.weight("rebuild_cost") == 0.30


def test_a_given_weight_overrides_the_scorers_own() -> None:
    registry = CheckpointScorerRegistry()
    registry.register(FixedScorer("a", 0.7, 0.5), weight=0.0)
    assert registry.weight("a") == 0.0
    registry.set_weight("a", 3)
    assert registry.weight("a") == 3.0


def test_malformed_scorers_are_refused() -> None:
    class NoName:
        weight = 1.0

        def score(self, observation: CheckpointObservation) -> CheckpointSignal:
            raise AssertionError

    class NoScore:
        name = "no_score"
        weight = 1.0

    registry = CheckpointScorerRegistry()
    with pytest.raises(TypeError, match="name"):
        registry.register(NoName())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="score"):
        registry.register(NoScore())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        registry.register(FixedScorer("", 1.0, 0.5))


def test_default_registry_is_fresh_each_time() -> None:
    first = default_registry()
    first.unregister("phase_boundary")
    assert "phase_boundary" in default_registry()


def test_a_new_signal_is_one_register_call() -> None:
    registry = default_registry()
    registry.register(LegalHoldScorer())
    advisor = CheckpointAdvisor(registry)
    held = advisor.recommend(
        CheckpointObservation(context_tokens=60_000, extras={"legal_hold": True})
    )
    assert held.vetoed_by == ("legal_hold",)
    assert not held.worth_it
    free = advisor.recommend(
        CheckpointObservation(context_tokens=60_000, extras={"legal_hold": False})
    )
    assert free.worth_it
    # Weight 0: it answered, but it moves the aggregate neither way.
    assert free.score == advisor.recommend(CheckpointObservation(context_tokens=60_000)).score


def test_removing_a_default_removes_its_signal() -> None:
    registry = default_registry()
    registry.unregister("phase_boundary")
    recommendation = CheckpointAdvisor(registry).recommend(
        CheckpointObservation(phase_completed=True)
    )
    assert "phase_boundary" not in {signal.name for signal in recommendation.signals}
    assert "phase_boundary" not in recommendation.abstained
