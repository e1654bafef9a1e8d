"""What the scorers read about one moment of a run.

Every measured field is optional and the distinction is load-bearing: ``None`` means "not
measured", ``0`` means "measured zero". A scorer whose inputs are ``None`` abstains instead of
reading the gap as a zero. Deployment-specific scorers read ``extras``, so adding a signal never
edits this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from kvci_plugin.worthiness.bundles import ContextBundle, EvidenceBundle, derive_observation_fields

MAX_COUNT = 10**15
"""Largest count an observation field takes: far past any real context, and exact as a float
(the scorers divide counts; 1e308 and more would overflow them)."""
MAX_WALL_TIME_S = 1e9
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_COUNT)]

_STRICT_FROZEN = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

_Bundle = TypeVar("_Bundle", EvidenceBundle, ContextBundle)


class ModelSelfReport(BaseModel):
    """The model's own flag that it has a strong working understanding of its task.

    Evidence, not authority: the ``model_self_report`` scorer weighs it least and the advisor
    never recommends a checkpoint on it alone.
    """

    model_config = _STRICT_FROZEN

    understood: bool
    # How sure the model is of its flag; None = it gave no number (read as fully sure).
    confidence: Annotated[float, Field(ge=0.0, le=1.0)] | None = None


class CheckpointObservation(BaseModel):
    """One moment of a run, as far as it was measured."""

    model_config = _STRICT_FROZEN

    # Size and cost of the context (read by rebuild_cost).
    context_tokens: NonNegativeInt | None = None
    output_tokens: NonNegativeInt | None = None
    cached_tokens: NonNegativeInt | None = Field(
        default=None, description="tokens already cached when the request arrived"
    )
    tool_calls: NonNegativeInt | None = None
    tool_call_pending: bool | None = Field(
        default=None, description="the turn ends waiting on a tool call: the run will be back "
        "(read by the retention advice)")
    retrievals: NonNegativeInt | None = None
    wall_time_s: Annotated[float, Field(ge=0.0, le=MAX_WALL_TIME_S)] | None = Field(
        default=None,
        description="time that assembled the context; the engine passes prefill time when the "
                    "client gives none",
    )
    # Expected reuse (read by predicted_reuse).
    sibling_tasks: NonNegativeInt | None = None
    queued_tasks: NonNegativeInt | None = None
    observed_reuse: NonNegativeInt | None = Field(
        default=None,
        description="re-sends of this context seen so far (the engine counts a session's turns "
        "since its context last changed, or without a session the loads of the prefix it loaded)",
    )
    # Convergence of what entered the context (read by retrieval_saturation): the items retrieved
    # or included (a compiled context's items, e.g. a turn's prompt blocks) and those of them not
    # already known to the run.
    retrieved_items: NonNegativeInt | None = None
    novel_items: NonNegativeInt | None = None
    # Grounding (read by grounding_density).
    evidence_spans: NonNegativeInt | None = None
    claims: NonNegativeInt | None = None
    # Contradictions (read by contradictions); high severity counts unresolved ones only.
    contradictions_unresolved: NonNegativeInt | None = None
    contradictions_high_severity: NonNegativeInt | None = None
    # Churn (read by context_stability), counted over the caller's recent window.
    context_rewrites: NonNegativeInt | None = None
    context_evictions: NonNegativeInt | None = None
    turns_since_change: NonNegativeInt | None = None
    # Phase of the task (read by phase_boundary).
    phase: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    phase_completed: bool | None = None
    self_report: ModelSelfReport | None = None
    extras: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent_counts(self) -> CheckpointObservation:
        _require_at_most(self.novel_items, "novel_items", self.retrieved_items, "retrieved_items")
        _require_at_most(
            self.contradictions_high_severity,
            "contradictions_high_severity",
            self.contradictions_unresolved,
            "contradictions_unresolved",
        )
        _require_at_most(self.cached_tokens, "cached_tokens", self.context_tokens, "context_tokens")
        return self

    @classmethod
    def from_inputs(
        cls,
        observation: Mapping[str, Any] | CheckpointObservation | None = None,
        evidence_bundle: Mapping[str, Any] | EvidenceBundle | None = None,
        context_bundle: Mapping[str, Any] | ContextBundle | None = None,
    ) -> CheckpointObservation:
        """Build an observation from JSON inputs.

        The grounding, contradiction and novelty fields are derived from the bundles; an
        explicit, non-null observation field always wins over a derived one, because a caller's
        direct measurement is more authoritative than an inference. An explicit ``null`` means
        "not measured" and so does not erase what a bundle measured.
        """
        evidence = _as_bundle(evidence_bundle, EvidenceBundle, "evidence_bundle")
        context = _as_bundle(context_bundle, ContextBundle, "context_bundle")
        if isinstance(observation, CheckpointObservation):
            explicit: Mapping[str, Any] = {
                name: getattr(observation, name) for name in type(observation).model_fields
            }
        elif observation is None:
            explicit = {}
        elif isinstance(observation, Mapping):
            explicit = observation
        else:
            raise TypeError(
                "observation must be a mapping or a CheckpointObservation, got "
                f"{type(observation).__name__}"
            )
        merged: dict[str, Any] = dict(derive_observation_fields(evidence, context))
        merged.update((key, value) for key, value in explicit.items() if value is not None)
        return cls.model_validate(merged)


def _require_at_most(part: int | None, part_name: str, whole: int | None, whole_name: str) -> None:
    if part is not None and whole is not None and part > whole:
        raise ValueError(f"{part_name} ({part}) cannot exceed {whole_name} ({whole})")


def _as_bundle(
    value: Mapping[str, Any] | _Bundle | None, model: type[_Bundle], field: str
) -> _Bundle | None:
    if value is None or isinstance(value, model):
        return value
    if isinstance(value, Mapping):
        return model.model_validate(value)
    raise TypeError(
        f"{field} must be a JSON object or a {model.__name__}, got {type(value).__name__}"
    )
