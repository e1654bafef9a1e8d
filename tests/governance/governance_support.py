"""Helpers shared by the governance tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvci_plugin.governance import CredentialIssuer, SourceLabels

TENANT = "acme"
ACTOR = "alice"


class DictResolver:
    """An in-memory SourceLabelResolver: ids it does not know come back unlabelled."""

    def __init__(self, labels: Mapping[str, SourceLabels | None]) -> None:
        self.labels = dict(labels)

    def resolve(self, source_ids: Sequence[str],
                tenant: str | None = None) -> dict[str, SourceLabels | None]:
        return {source_id: self.labels.get(source_id) for source_id in source_ids}


def session_token(issuer: CredentialIssuer, **overrides: object) -> str:
    """A session for ACTOR in TENANT that covers the `full_labels` sources, unless overridden."""
    claims: dict[str, object] = {
        "actor": ACTOR,
        "tenant": TENANT,
        "scopes": ["kv:persist", "kv:read"],
        "clearance": "CONFIDENTIAL",
        "markings": ["pii", "finance"],
        "regions": ["eu", "us"],
        "policy_version": 7,
    }
    claims.update(overrides)
    return issuer.issue_session(**claims)  # type: ignore[arg-type]


def full_labels(**overrides: object) -> SourceLabels:
    """A fully declared label that `session_token()`'s default authority dominates in region eu."""
    fields: dict[str, object] = {
        "classification": "INTERNAL",
        "residency_regions": ["eu", "us"],
        "retention_days": 30,
        "mandatory_markings": ["pii"],
    }
    fields.update(overrides)
    return SourceLabels.model_validate(fields)
