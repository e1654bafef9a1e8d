from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvci_plugin.worthiness import ContextBundle, EvidenceBundle, derive_observation_fields


def evidence(**fields: object) -> EvidenceBundle:
    return EvidenceBundle.model_validate(fields)


def test_an_absent_list_measures_nothing_and_an_empty_one_measures_zero() -> None:
    assert derive_observation_fields(evidence(), None) == {}
    assert derive_observation_fields(evidence(items=[], claims=[], contradictions=[]), None) == {
        "retrieved_items": 0,
        "novel_items": 0,
        "claims": 0,
        "evidence_spans": 0,
        "contradictions_unresolved": 0,
        "contradictions_high_severity": 0,
    }


def test_novelty_is_derived_only_when_every_item_states_it() -> None:
    partial = derive_observation_fields(
        evidence(items=[{"id": "a", "novel": True}, {"id": "b"}]), None
    )
    assert partial == {"retrieved_items": 2}
    full = derive_observation_fields(
        evidence(items=[{"id": "a", "novel": True}, {"id": "b", "novel": False}]), None
    )
    assert full == {"retrieved_items": 2, "novel_items": 1}


def test_evidence_spans_count_distinct_spans_per_claim() -> None:
    derived = derive_observation_fields(
        evidence(claims=[{"id": "c1", "evidence": ["s1", "s2"]}, {"id": "c2", "evidence": ["s1"]}]),
        None,
    )
    assert derived == {"claims": 2, "evidence_spans": 3}
    with pytest.raises(ValidationError, match="claims"):
        evidence(claims=[{"id": "c1"}, {"id": "c1"}])


def test_only_unresolved_contradictions_count_and_high_is_a_subset() -> None:
    derived = derive_observation_fields(
        evidence(
            contradictions=[
                {"id": "x1", "severity": "high", "resolved": True},
                {"id": "x2", "severity": "high", "resolved": False},
                {"id": "x3", "severity": "medium", "resolved": False},
            ]
        ),
        None,
    )
    assert derived == {"contradictions_unresolved": 2, "contradictions_high_severity": 1}


def test_context_bundle_reports_dropped_items_as_evictions() -> None:
    derived = derive_observation_fields(
        None, ContextBundle.model_validate({"items": [{"id": "a"}], "dropped_items": 2})
    )
    assert derived == {"retrieved_items": 1, "context_evictions": 2}
    with pytest.raises(ValidationError, match="dropped_items"):
        evidence(dropped_items=2)


def test_the_same_record_in_both_bundles_is_merged_cautiously() -> None:
    retrieval = evidence(
        items=[{"id": "a", "novel": False}, {"id": "b", "novel": False}],
        claims=[{"id": "c1", "evidence": ["s1"]}],
        contradictions=[{"id": "x", "severity": "high", "resolved": True}],
    )
    compiled = ContextBundle.model_validate(
        {
            "items": [{"id": "a", "novel": True}, {"id": "c"}],
            "claims": [{"id": "c1", "evidence": ["s1", "s2"]}],
            "contradictions": [{"id": "x", "severity": "low", "resolved": False}],
        }
    )
    derived = derive_observation_fields(retrieval, compiled)
    assert derived["retrieved_items"] == 3  # a, b, c: a is counted once
    assert "novel_items" not in derived  # c never states novelty
    assert derived["claims"] == 1
    assert derived["evidence_spans"] == 2  # union of s1 and s1, s2
    # Unresolved in one bundle is unresolved, at the higher of the two severities.
    assert derived["contradictions_unresolved"] == 1
    assert derived["contradictions_high_severity"] == 1


def test_novel_in_either_bundle_is_novel() -> None:
    derived = derive_observation_fields(
        evidence(items=[{"id": "a", "novel": False}]),
        ContextBundle.model_validate({"items": [{"id": "a", "novel": True}]}),
    )
    assert derived == {"retrieved_items": 1, "novel_items": 1}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"contradiction": []}, "contradiction"),
        ({"items": [{"id": "a"}, {"id": "a"}]}, "duplicate id 'a'"),
        ({"contradictions": [{"id": "x", "severity": "fatal", "resolved": False}]}, "severity"),
        ({"contradictions": [{"id": "x", "severity": "high"}]}, "resolved"),
        ({"items": [{"id": ""}]}, "id"),
        ({"items": [{"id": "a", "novel": "yes"}]}, "novel"),
        ({"items": {"id": "a"}}, "items"),
    ],
)
def test_bad_bundles_are_refused_with_a_clear_error(
    payload: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        EvidenceBundle.model_validate(payload)


def test_bundles_parse_from_json_text() -> None:
    bundle = ContextBundle.model_validate_json(
        '{"items": [{"id": "a", "novel": false}], "dropped_items": 0}'
    )
    assert derive_observation_fields(None, bundle) == {
        "retrieved_items": 1,
        "novel_items": 0,
        "context_evictions": 0,
    }
