"""Source labels and their most-restrictive composition."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvci_plugin.governance.classification import Classification
from kvci_plugin.governance.names import NameSet

LABEL_AXES = ("classification", "residency_regions", "retention_days", "mandatory_markings")


class SourceLabels(BaseModel):
    """One source's governance labels. Every field defaults to None = undeclared, which denies.

    An empty `residency_regions` is declared and means "may reside nowhere"; an empty
    `mandatory_markings` is declared and means "no markings required".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    classification: Classification | None = None
    residency_regions: NameSet | None = None
    retention_days: Annotated[StrictInt, Field(ge=0)] | None = None
    mandatory_markings: NameSet | None = None


class SourceContribution(BaseModel):
    """What one source brings to the composition: its labels as resolved, the axes it leaves
    undeclared, and the axes derived from an explicit PUBLIC classification."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source_id: str
    labels: SourceLabels | None
    missing_labels: tuple[str, ...]
    derived_axes: tuple[str, ...]

    @classmethod
    def of(cls, source_id: str, labels: SourceLabels | None) -> SourceContribution:
        if labels is None:
            return cls(source_id=source_id, labels=None, missing_labels=LABEL_AXES, derived_axes=())
        # The only derivation from a present label: explicit PUBLIC fills an undeclared residency
        # (unrestricted) and retention (no limit). An explicit declaration always stands.
        derived = tuple(
            axis
            for axis in ("residency_regions", "retention_days")
            if labels.classification is Classification.PUBLIC and getattr(labels, axis) is None
        )
        missing = tuple(
            axis for axis in LABEL_AXES if getattr(labels, axis) is None and axis not in derived
        )
        return cls(source_id=source_id, labels=labels, missing_labels=missing, derived_axes=derived)


class ComposedLabel(BaseModel):
    """The most restrictive composition of every contributing source's labels."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    classification: Classification
    residency_regions: NameSet | None = Field(
        description="None = unrestricted (every source PUBLIC-derived)"
    )
    retention_days: int | None = Field(description="None = no limit (every source PUBLIC-derived)")
    mandatory_markings: NameSet
    derived_axes: tuple[str, ...] = Field(
        description="axes read from an explicit PUBLIC, naming the source"
    )


def compose_labels(labels: Mapping[str, SourceLabels | None]) -> ComposedLabel:
    """Classification max, residency intersection, retention min, markings union.

    Raises ValueError when there are no sources or any source leaves an axis undeclared:
    absence never composes into something permissive.
    """
    return compose_contributions(
        [SourceContribution.of(source_id, labels) for source_id, labels in labels.items()]
    )


def compose_contributions(contributions: Sequence[SourceContribution]) -> ComposedLabel:
    """`compose_labels` over contributions already computed (the gate records them first)."""
    if not contributions:
        raise ValueError("labels: no sources to compose")
    incomplete = [
        f"{c.source_id!r} lacks {', '.join(c.missing_labels)}"
        for c in contributions
        if c.missing_labels
    ]
    if incomplete:
        raise ValueError(f"labels: cannot compose, {'; '.join(incomplete)}")

    # Complete from here on: an axis still None was derived from PUBLIC and restricts nothing.
    classification = Classification.PUBLIC
    residency: frozenset[str] | None = None
    retention: int | None = None
    markings: frozenset[str] = frozenset()
    for contribution in contributions:
        labels = contribution.labels
        if labels is None:  # refused above as incomplete
            continue
        if labels.classification is not None:
            classification = max(classification, labels.classification)
        if labels.residency_regions is not None:
            residency = (
                labels.residency_regions
                if residency is None
                else residency & labels.residency_regions
            )
        if labels.retention_days is not None:
            retention = (
                labels.retention_days
                if retention is None
                else min(retention, labels.retention_days)
            )
        if labels.mandatory_markings is not None:
            markings |= labels.mandatory_markings
    return ComposedLabel(
        classification=classification,
        residency_regions=residency,
        retention_days=retention,
        mandatory_markings=markings,
        derived_axes=tuple(
            f"{axis}: {_DERIVED_MEANING[axis]} (PUBLIC source {c.source_id!r})"
            for c in contributions
            for axis in c.derived_axes
        ),
    )


_DERIVED_MEANING = {"residency_regions": "unrestricted", "retention_days": "no limit"}
