"""Hypothesis strategies for observations: every field independently measured or not."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvci_plugin.worthiness import CheckpointObservation, ModelSelfReport

counts = st.one_of(st.none(), st.integers(min_value=0, max_value=200_000))
small_counts = st.one_of(st.none(), st.integers(min_value=0, max_value=50))
seconds = st.one_of(
    st.none(), st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)
)
self_reports = st.one_of(
    st.none(),
    st.builds(
        ModelSelfReport,
        understood=st.booleans(),
        confidence=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0)),
    ),
)


@st.composite
def observations(draw: st.DrawFn) -> CheckpointObservation:
    fields: dict[str, Any] = {
        "context_tokens": draw(counts),
        "output_tokens": draw(counts),
        "tool_calls": draw(small_counts),
        "retrievals": draw(small_counts),
        "wall_time_s": draw(seconds),
        "sibling_tasks": draw(small_counts),
        "queued_tasks": draw(small_counts),
        "observed_reuse": draw(small_counts),
        "retrieved_items": draw(small_counts),
        "evidence_spans": draw(small_counts),
        "claims": draw(small_counts),
        "contradictions_unresolved": draw(small_counts),
        "context_rewrites": draw(small_counts),
        "context_evictions": draw(small_counts),
        "turns_since_change": draw(small_counts),
        "phase": draw(
            st.one_of(
                st.none(), st.sampled_from(["understand", "plan", "Plan", "execute", "review"])
            )
        ),
        "phase_completed": draw(st.one_of(st.none(), st.booleans())),
        "self_report": draw(self_reports),
    }
    # Keep the cross-field invariants the model enforces: parts never exceed their whole.
    retrieved = fields["retrieved_items"]
    fields["novel_items"] = (
        draw(st.one_of(st.none(), st.integers(0, retrieved))) if retrieved is not None else None
    )
    unresolved = fields["contradictions_unresolved"]
    fields["contradictions_high_severity"] = (
        draw(st.one_of(st.none(), st.integers(0, unresolved))) if unresolved is not None else None
    )
    context = fields["context_tokens"]
    fields["cached_tokens"] = (
        draw(st.one_of(st.none(), st.integers(0, context))) if context is not None else None
    )
    return CheckpointObservation(**fields)
