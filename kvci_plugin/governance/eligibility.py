"""The persistence eligibility gate protocol and the order its checks run in."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvci_plugin.governance.decision import EligibilityDecision
from kvci_plugin.governance.request import PersistenceRequest

# Binding: every gate runs its checks in this order. Each check refuses on its own, the first
# failure ends the evaluation.
CHECK_ORDER: tuple[str, ...] = (
    "verified_authority",
    "tenancy",
    "durable_write_scope",
    "source_provenance",
    "labels_present",
    "classification",
    "mandatory_markings",
    "residency",
    "retention",
)


@runtime_checkable
class PersistenceEligibilityGate(Protocol):
    """Decides whether a checkpoint may be written to the durable store. Deny by default."""

    name: str

    def evaluate(self, request: PersistenceRequest) -> EligibilityDecision: ...
