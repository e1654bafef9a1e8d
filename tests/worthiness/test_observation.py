from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from kvci_plugin.worthiness import (
    CheckpointObservation,
    ContextBundle,
    EvidenceBundle,
    ModelSelfReport,
)

COUNT_FIELDS = [
    "context_tokens",
    "output_tokens",
    "cached_tokens",
    "tool_calls",
    "retrievals",
    "sibling_tasks",
    "queued_tasks",
    "observed_reuse",
    "retrieved_items",
    "novel_items",
    "evidence_spans",
    "claims",
    "contradictions_unresolved",
    "contradictions_high_severity",
    "context_rewrites",
    "context_evictions",
    "turns_since_change",
]


def test_every_measured_field_defaults_to_not_measured() -> None:
    observation = CheckpointObservation()
    for name in CheckpointObservation.model_fields:
        if name != "extras":
            assert getattr(observation, name) is None, name
    assert observation.extras == {}


def test_measured_zero_is_kept_apart_from_not_measured() -> None:
    assert CheckpointObservation(tool_calls=0).tool_calls == 0
    assert CheckpointObservation(tool_calls=0) != CheckpointObservation()


@pytest.mark.parametrize("field", COUNT_FIELDS)
def test_negative_counts_are_rejected_naming_the_field(field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointObservation.model_validate({field: -1})
    assert field in str(info.value)


@pytest.mark.parametrize("bad", ["3", 3.0, True])
def test_counts_are_strict_ints(bad: object) -> None:
    with pytest.raises(ValidationError, match="context_tokens"):
        CheckpointObservation.model_validate({"context_tokens": bad})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.5, "1.0"])
def test_wall_time_must_be_finite_and_non_negative(bad: object) -> None:
    with pytest.raises(ValidationError, match="wall_time_s"):
        CheckpointObservation.model_validate({"wall_time_s": bad})


def test_wall_time_accepts_an_int_number_of_seconds() -> None:
    assert CheckpointObservation(wall_time_s=2).wall_time_s == 2.0


def test_unknown_fields_are_forbidden() -> None:
    with pytest.raises(ValidationError, match="tool_call"):
        CheckpointObservation.model_validate({"tool_call": 3})


def test_observation_is_frozen() -> None:
    observation = CheckpointObservation(tool_calls=1)
    with pytest.raises(ValidationError):
        observation.tool_calls = 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"retrieved_items": 2, "novel_items": 3}, "novel_items"),
        (
            {"contradictions_unresolved": 1, "contradictions_high_severity": 2},
            "contradictions_high_severity",
        ),
        ({"context_tokens": 10, "cached_tokens": 11}, "cached_tokens"),
    ],
)
def test_a_part_cannot_exceed_its_whole(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CheckpointObservation.model_validate(fields)


def test_self_report_confidence_is_bounded() -> None:
    with pytest.raises(ValidationError, match="confidence"):
        ModelSelfReport(understood=True, confidence=1.5)


def test_extras_carry_json_like_values_only() -> None:
    observation = CheckpointObservation(
        extras={"legal_hold": True, "tags": ["a", {"b": None}], "n": 1.5}
    )
    assert observation.extras["tags"] == ["a", {"b": None}]
    with pytest.raises(ValidationError, match="extras"):
        CheckpointObservation.model_validate({"extras": {"when": object()}})


def test_observation_round_trips_through_json() -> None:
    observation = CheckpointObservation(
        context_tokens=10,
        wall_time_s=0.25,
        phase="plan",
        phase_completed=True,
        self_report=ModelSelfReport(understood=True, confidence=0.5),
        extras={"k": [1, 2]},
    )
    assert CheckpointObservation.model_validate_json(observation.model_dump_json()) == observation


EVIDENCE = {
    "items": [{"id": "a", "novel": True}, {"id": "b", "novel": False}, {"id": "c", "novel": False}],
    "claims": [{"id": "c1", "evidence": ["a", "b"]}, {"id": "c2", "evidence": []}],
    "contradictions": [{"id": "x", "severity": "low", "resolved": False}],
}


def test_from_inputs_derives_the_bundle_axes() -> None:
    observation = CheckpointObservation.from_inputs(evidence_bundle=EVIDENCE)
    assert observation.retrieved_items == 3
    assert observation.novel_items == 1
    assert observation.claims == 2
    assert observation.evidence_spans == 2
    assert observation.contradictions_unresolved == 1
    assert observation.contradictions_high_severity == 0
    assert observation.context_tokens is None


def test_explicit_fields_win_over_derived_ones() -> None:
    observation = CheckpointObservation.from_inputs(
        observation={"claims": 5, "novel_items": 0, "context_tokens": 100},
        evidence_bundle=EVIDENCE,
    )
    assert observation.claims == 5
    assert observation.novel_items == 0
    assert observation.evidence_spans == 2
    assert observation.context_tokens == 100


def test_an_explicit_null_does_not_erase_a_measured_value() -> None:
    observation = CheckpointObservation.from_inputs(
        observation={"claims": None}, evidence_bundle=EVIDENCE
    )
    assert observation.claims == 2


def test_from_inputs_accepts_models_as_well_as_json_objects() -> None:
    explicit = CheckpointObservation(claims=9, self_report=ModelSelfReport(understood=False))
    observation = CheckpointObservation.from_inputs(
        observation=explicit,
        evidence_bundle=EvidenceBundle.model_validate(EVIDENCE),
        context_bundle=ContextBundle(dropped_items=4),
    )
    assert observation.claims == 9
    assert observation.self_report == ModelSelfReport(understood=False)
    assert observation.retrieved_items == 3
    assert observation.context_evictions == 4


def test_from_inputs_validates_the_merged_result() -> None:
    # The explicit retrieved_items=0 wins, and the bundle's 1 novel item no longer fits: refuse.
    with pytest.raises(ValidationError, match="novel_items"):
        CheckpointObservation.from_inputs(
            observation={"retrieved_items": 0}, evidence_bundle=EVIDENCE
        )


def test_from_inputs_rejects_non_mapping_inputs() -> None:
    with pytest.raises(TypeError, match="evidence_bundle"):
        CheckpointObservation.from_inputs(evidence_bundle='{"items": []}')  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="observation"):
        CheckpointObservation.from_inputs(observation=[("claims", 1)])  # type: ignore[arg-type]


def test_from_inputs_with_nothing_is_an_empty_observation() -> None:
    assert CheckpointObservation.from_inputs() == CheckpointObservation()
