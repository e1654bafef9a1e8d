"""Retrieval and context-compile results, handed over as JSON, and the observation axes they give.

An agent that just ran a retrieval (``evidence_bundle``) or compiled a context
(``context_bundle``) hands the result over instead of counting by hand. Both share one small
shape; every list is optional because an absent list means "the producer did not report it",
while an empty list means "it reported none"::

    {
      "items":          [{"id": "doc-7#p2", "novel": true}, ...],        # retrieved / included
      "claims":         [{"id": "c1", "evidence": ["doc-7#p2"]}, ...],  # with their cited spans
      "contradictions": [{"id": "x1", "severity": "high", "resolved": false}, ...],
      "dropped_items":  3                                              # context_bundle only
    }

Derived observation fields: ``retrieved_items`` (distinct item ids), ``novel_items`` (only when
every item states ``novel``), ``claims``, ``evidence_spans`` (distinct cited spans per claim,
summed), ``contradictions_unresolved``, ``contradictions_high_severity`` (unresolved and high),
``context_evictions`` (``dropped_items``: candidates the compile left out of the context).

When both bundles are given, records with the same id describe the same thing and are merged,
cautiously: an item is novel if either says so, a claim's evidence is the union, and a
contradiction is unresolved if either says so, at the higher severity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

_STRICT_FROZEN = ConfigDict(frozen=True, strict=True, extra="forbid")

BundleId = Annotated[str, Field(min_length=1, max_length=256)]
# Records per list: far above any real retrieval or compile, low enough that a bundle handed in
# over REST cannot make the per-request derivation expensive.
MAX_RECORDS = 10_000
Severity = Literal["low", "medium", "high"]
_SEVERITY_RANK: dict[str, int] = {"low": 0, "medium": 1, "high": 2}


class BundleItem(BaseModel):
    """A retrieved or included item; ``novel`` = not already known to the run (None = not said)."""

    model_config = _STRICT_FROZEN

    id: BundleId
    novel: bool | None = None


class BundleClaim(BaseModel):
    """A statement the run makes, with the ids of the evidence spans it cites."""

    model_config = _STRICT_FROZEN

    id: BundleId
    evidence: list[BundleId] = Field(default_factory=list, max_length=MAX_RECORDS)


class BundleContradiction(BaseModel):
    """A detected conflict between claims or sources."""

    model_config = _STRICT_FROZEN

    id: BundleId
    severity: Severity
    resolved: bool


_Record = TypeVar("_Record", BundleItem, BundleClaim, BundleContradiction)


def _unique_ids(records: list[_Record] | None, field: str) -> list[_Record] | None:
    if records is not None:
        seen: set[str] = set()
        for record in records:
            if record.id in seen:
                raise ValueError(f"{field}: duplicate id {record.id!r}")
            seen.add(record.id)
    return records


class EvidenceBundle(BaseModel):
    """The result of a retrieval: what came back, what it supports, what conflicts."""

    model_config = _STRICT_FROZEN

    items: list[BundleItem] | None = Field(default=None, max_length=MAX_RECORDS)
    claims: list[BundleClaim] | None = Field(default=None, max_length=MAX_RECORDS)
    contradictions: list[BundleContradiction] | None = Field(default=None, max_length=MAX_RECORDS)

    @field_validator("items", "claims", "contradictions")
    @classmethod
    def _ids_unique(
        cls, records: list[_Record] | None, info: ValidationInfo
    ) -> list[_Record] | None:
        return _unique_ids(records, info.field_name or "records")


class ContextBundle(EvidenceBundle):
    """The result of a context compile: what went into the context, and how much was left out."""

    dropped_items: Annotated[int, Field(ge=0, le=10**15)] | None = None


def derive_observation_fields(
    evidence: EvidenceBundle | None, context: ContextBundle | None
) -> dict[str, int]:
    """Observation fields measured by the bundles; a field no bundle reported is absent."""
    bundles: list[EvidenceBundle] = [bundle for bundle in (evidence, context) if bundle is not None]
    derived: dict[str, int] = {}
    items = _merged(bundle.items for bundle in bundles)
    if items is not None:
        derived["retrieved_items"] = len(items)
        novelty = [_any_flag(item.novel for item in group) for group in items.values()]
        if all(flag is not None for flag in novelty):
            derived["novel_items"] = sum(1 for flag in novelty if flag)
    claims = _merged(bundle.claims for bundle in bundles)
    if claims is not None:
        derived["claims"] = len(claims)
        derived["evidence_spans"] = sum(
            len({span for claim in group for span in claim.evidence}) for group in claims.values()
        )
    contradictions = _merged(bundle.contradictions for bundle in bundles)
    if contradictions is not None:
        open_severities = [
            max(_SEVERITY_RANK[record.severity] for record in group)
            for group in contradictions.values()
            if any(not record.resolved for record in group)
        ]
        derived["contradictions_unresolved"] = len(open_severities)
        derived["contradictions_high_severity"] = sum(
            1 for rank in open_severities if rank == _SEVERITY_RANK["high"]
        )
    if context is not None and context.dropped_items is not None:
        derived["context_evictions"] = context.dropped_items
    return derived


def _merged(lists: Iterable[list[_Record] | None]) -> dict[str, list[_Record]] | None:
    """Group records by id across bundles; None when no bundle reported the list at all."""
    reported = [records for records in lists if records is not None]
    if not reported:
        return None
    groups: dict[str, list[_Record]] = {}
    for records in reported:
        for record in records:
            groups.setdefault(record.id, []).append(record)
    return groups


def _any_flag(flags: Iterable[bool | None]) -> bool | None:
    stated: Sequence[bool] = [flag for flag in flags if flag is not None]
    return any(stated) if stated else None
