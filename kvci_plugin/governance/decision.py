"""The gate's answer and its derivation: "why was this (not) persisted?"."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from kvci_plugin.governance.authority import EffectiveAuthority
from kvci_plugin.governance.credentials import DelegationCeiling
from kvci_plugin.governance.labels import ComposedLabel, SourceContribution

CheckVerdict = Literal["pass", "fail", "not_run"]


class CheckRecord(BaseModel):
    """One check as it ran. `sources` and `labels` name what made it fail."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    verdict: CheckVerdict
    detail: str
    sources: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()


class PersistenceDerivation(BaseModel):
    """Effective authority (with its delegation chain), per-source contributions, the composed
    label and every check in the order it ran. Parts a refusal never reached are None / empty."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    authority: EffectiveAuthority | None = None
    sources: tuple[SourceContribution, ...] = ()
    composed_label: ComposedLabel | None = None
    checks: tuple[CheckRecord, ...] = ()

    @property
    def delegation_chain(self) -> tuple[DelegationCeiling, ...]:
        return () if self.authority is None else self.authority.delegation_chain

    @property
    def derived_axes(self) -> tuple[str, ...]:
        return () if self.composed_label is None else self.composed_label.derived_axes


class EligibilityDecision(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    permitted: bool
    gate: str
    checkpoint_id: str
    trigger: str
    failed_check: str | None
    reason: str
    derivation: PersistenceDerivation
    retention_expiry: float | None = None  # unix seconds; None = no limit (or refused)
    evaluated_at: float

    @model_validator(mode="after")
    def _consistent(self) -> EligibilityDecision:
        if self.permitted and self.failed_check is not None:
            raise ValueError(f"a permit cannot name a failed check ({self.failed_check!r})")
        if not self.permitted and self.failed_check is None:
            raise ValueError("a refusal must name the check that failed")
        if self.permitted and any(check.verdict != "pass" for check in self.derivation.checks):
            raise ValueError("a permit requires every check to pass")
        return self
