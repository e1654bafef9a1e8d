"""The default eligibility gate: authority derived from credentials must dominate the
most restrictive composition of every contributing source's labels, in the same tenancy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TypeVar

from kvci_plugin.governance.authority import EffectiveAuthority, derive_effective_authority
from kvci_plugin.governance.credential_error import CredentialError
from kvci_plugin.governance.decision import CheckRecord, EligibilityDecision, PersistenceDerivation
from kvci_plugin.governance.eligibility import CHECK_ORDER
from kvci_plugin.governance.label_resolver import SourceLabelResolver
from kvci_plugin.governance.labels import (
    LABEL_AXES,
    ComposedLabel,
    SourceContribution,
    SourceLabels,
    compose_contributions,
)
from kvci_plugin.governance.request import PersistenceRequest
from kvci_plugin.governance.seams import get_source_label_resolver
from kvci_plugin.governance.verifier import CredentialVerifier

_SECONDS_PER_DAY = 86_400.0
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Outcome:
    passed: bool
    detail: str
    sources: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()


@dataclass
class _Evaluation:
    """What the checks have established so far; each check reads what earlier ones set."""

    request: PersistenceRequest
    evaluated_at: float
    authority: EffectiveAuthority | None = None
    contributions: tuple[SourceContribution, ...] = field(default=())
    composed: ComposedLabel | None = None
    retention_expiry: float | None = None


class DerivedAuthorityGate:
    """Runs the eligibility checks in ``CHECK_ORDER`` and refuses at the first failure, naming it.

    Authority is derived from the request's tokens on every evaluation (never cached), so a
    session that expired or a delegation revoked since a checkpoint was taken refuses.
    `resolver=None` reads the seam's resolver at each evaluation.
    """

    name = "derived_authority"

    def __init__(
        self,
        verifier: CredentialVerifier | None,
        resolver: SourceLabelResolver | None = None,
        *,
        durable_store_region: str | None = None,
        required_scope: str = "kv:persist",
    ) -> None:
        if verifier is not None and not isinstance(verifier, CredentialVerifier):
            raise TypeError(
                f"verifier must be a CredentialVerifier or None, got {type(verifier).__name__}"
            )
        if resolver is not None and not isinstance(resolver, SourceLabelResolver):
            raise TypeError(
                "resolver must implement SourceLabelResolver or be None, got "
                f"{type(resolver).__name__}"
            )
        if durable_store_region is not None and not durable_store_region:
            raise ValueError(
                "durable_store_region must be a non-empty region name or None (unknown)"
            )
        if not required_scope:
            raise ValueError("required_scope must be a non-empty scope name")
        self.verifier = verifier
        self.resolver = resolver
        self.durable_store_region = durable_store_region
        self.required_scope = required_scope
        checks: dict[str, Callable[[_Evaluation], _Outcome]] = {
            "verified_authority": self._verified_authority,
            "tenancy": self._tenancy,
            "durable_write_scope": self._durable_write_scope,
            "source_provenance": self._source_provenance,
            "labels_present": self._labels_present,
            "classification": self._classification,
            "mandatory_markings": self._mandatory_markings,
            "residency": self._residency,
            "retention": self._retention,
        }
        self._checks = [(name, checks[name]) for name in CHECK_ORDER]

    def evaluate(self, request: PersistenceRequest) -> EligibilityDecision:
        if not isinstance(request, PersistenceRequest):
            raise TypeError(f"request must be a PersistenceRequest, got {type(request).__name__}")
        state = _Evaluation(request=request, evaluated_at=time.time())
        records: list[CheckRecord] = []
        failed: CheckRecord | None = None
        for name, check in self._checks:
            if failed is not None:
                records.append(
                    CheckRecord(
                        name=name, verdict="not_run", detail=f"not run: refused at {failed.name}"
                    )
                )
                continue
            outcome = check(state)
            records.append(
                CheckRecord(
                    name=name,
                    verdict="pass" if outcome.passed else "fail",
                    detail=outcome.detail,
                    sources=outcome.sources,
                    labels=outcome.labels,
                )
            )
            if not outcome.passed:
                failed = records[-1]
        if failed is None:
            reason = self._permit_reason(state)
        else:
            reason = f"refused at {failed.name}: {failed.detail}"
        return EligibilityDecision(
            permitted=failed is None,
            gate=self.name,
            checkpoint_id=request.checkpoint_id,
            trigger=request.trigger,
            failed_check=None if failed is None else failed.name,
            reason=reason,
            derivation=PersistenceDerivation(
                authority=state.authority,
                sources=state.contributions,
                composed_label=state.composed,
                checks=tuple(records),
            ),
            retention_expiry=state.retention_expiry if failed is None else None,
            evaluated_at=state.evaluated_at,
        )

    def _verified_authority(self, state: _Evaluation) -> _Outcome:
        if self.verifier is None:
            return _Outcome(
                False, "no credential verifier is configured, so no authority can be verified"
            )
        request = state.request
        if request.session_token is None:
            return _Outcome(False, "no checked session: the request carries no session credential")
        try:
            authority = derive_effective_authority(
                self.verifier, request.session_token, request.delegation_tokens
            )
        except CredentialError as exc:
            what = (
                "unresolvable delegation ceiling"
                if exc.credential.startswith("delegation")
                else "session not verified"
            )
            return _Outcome(False, f"{what}: {exc}")
        state.authority = authority
        hops = len(authority.delegation_chain)
        return _Outcome(
            True,
            f"actor {authority.actor!r} of tenant {authority.tenant!r} (session "
            f"{authority.session_jti}), {hops} delegation ceiling(s) intersected",
        )

    def _tenancy(self, state: _Evaluation) -> _Outcome:
        authority = _known(state.authority)
        if authority.tenant != state.request.tenant:
            return _Outcome(
                False,
                f"the checkpoint belongs to tenant {state.request.tenant!r}, the session to "
                f"{authority.tenant!r}",
            )
        return _Outcome(True, f"session and checkpoint are both in tenant {authority.tenant!r}")

    def _durable_write_scope(self, state: _Evaluation) -> _Outcome:
        authority = _known(state.authority)
        if self.required_scope in authority.scopes:
            return _Outcome(True, f"effective authority holds scope {self.required_scope!r}")
        narrowing = [
            f"delegation[{index}] ({hop.delegator!r} -> {hop.delegate!r})"
            for index, hop in enumerate(authority.delegation_chain)
            if self.required_scope not in hop.scopes
        ]
        where = f"; withheld by {', '.join(narrowing)}" if narrowing else ""
        return _Outcome(False, f"effective authority lacks scope {self.required_scope!r}{where}")

    def _source_provenance(self, state: _Evaluation) -> _Outcome:
        source_ids = state.request.source_ids
        if not source_ids:
            return _Outcome(
                False, "no declared sources: a checkpoint of unknown provenance cannot be persisted"
            )
        resolver = self.resolver if self.resolver is not None else get_source_label_resolver()
        resolver_name = type(resolver).__name__
        try:
            resolved = resolver.resolve(source_ids, state.request.tenant)
        except Exception as exc:  # any resolver failure must become a recorded refusal
            return _Outcome(
                False, f"label resolver {resolver_name} failed: {exc!r}", sources=source_ids
            )
        if not isinstance(resolved, dict):
            return _Outcome(
                False,
                f"label resolver {resolver_name} returned {type(resolved).__name__}, not a dict",
            )
        omitted = tuple(source_id for source_id in source_ids if source_id not in resolved)
        if omitted:
            return _Outcome(
                False,
                f"label resolver {resolver_name} omitted source(s) {_quoted(omitted)}: "
                "a source must come back unlabelled, never vanish",
                sources=omitted,
            )
        state.contributions = tuple(
            _contribution(source_id, resolved[source_id]) for source_id in source_ids
        )
        return _Outcome(True, f"{len(source_ids)} declared source(s) resolved by {resolver_name}")

    def _labels_present(self, state: _Evaluation) -> _Outcome:
        incomplete = [c for c in state.contributions if c.missing_labels]
        if incomplete:
            missing = tuple(
                axis for axis in LABEL_AXES if any(axis in c.missing_labels for c in incomplete)
            )
            described = "; ".join(
                f"source {c.source_id!r} is unlabelled or unreadable"
                if c.labels is None
                else f"source {c.source_id!r} lacks {', '.join(c.missing_labels)}"
                for c in incomplete
            )
            return _Outcome(
                False, described, sources=tuple(c.source_id for c in incomplete), labels=missing
            )
        state.composed = compose_contributions(state.contributions)
        derived = state.composed.derived_axes
        return _Outcome(
            True,
            "every source is fully labelled"
            + (f"; derived: {'; '.join(derived)}" if derived else ""),
        )

    def _classification(self, state: _Evaluation) -> _Outcome:
        authority, composed = _known(state.authority), _known(state.composed)
        if authority.clearance >= composed.classification:
            return _Outcome(
                True,
                f"clearance {authority.clearance.value} covers classification "
                f"{composed.classification.value}",
            )
        above = [
            (c.source_id, c.labels.classification)
            for c in state.contributions
            if c.labels is not None
            and c.labels.classification is not None
            and c.labels.classification > authority.clearance
        ]
        return _Outcome(
            False,
            f"clearance {authority.clearance.value} is below the composed classification "
            f"{composed.classification.value}: "
            + ", ".join(
                f"source {source_id!r} is {classification.value}"
                for source_id, classification in above
            ),
            sources=tuple(source_id for source_id, _ in above),
            labels=("classification",),
        )

    def _mandatory_markings(self, state: _Evaluation) -> _Outcome:
        authority, composed = _known(state.authority), _known(state.composed)
        lacking = composed.mandatory_markings - authority.markings
        if not lacking:
            return _Outcome(
                True,
                "effective authority holds every mandatory marking "
                f"({_listed(composed.mandatory_markings)})",
            )
        requiring = tuple(
            c.source_id
            for c in state.contributions
            if c.labels is not None
            and c.labels.mandatory_markings is not None
            and c.labels.mandatory_markings & lacking
        )
        return _Outcome(
            False,
            f"effective authority lacks marking(s) {_listed(lacking)} required by source(s) "
            f"{_quoted(requiring)}",
            sources=requiring,
            labels=("mandatory_markings",),
        )

    def _residency(self, state: _Evaluation) -> _Outcome:
        authority, composed = _known(state.authority), _known(state.composed)
        requested, configured = state.request.durable_store_region, self.durable_store_region
        if requested is not None and configured is not None and requested != configured:
            return _Outcome(
                False,
                f"the request targets store region {requested!r}, this gate guards {configured!r}",
            )
        region = requested if requested is not None else configured
        restricting = [
            (c.source_id, c.labels.residency_regions)
            for c in state.contributions
            if c.labels is not None and c.labels.residency_regions is not None
        ]
        by_source = ", ".join(
            f"{source_id!r} ({_listed(regions)})" for source_id, regions in restricting
        )
        restricting_ids = tuple(source_id for source_id, _ in restricting)
        allowed = composed.residency_regions
        if allowed is not None and not allowed:
            return _Outcome(
                False,
                f"empty residency intersection: sources {by_source} share no region",
                sources=restricting_ids,
                labels=("residency_regions",),
            )
        if region is None:
            if allowed is not None:
                return _Outcome(
                    False,
                    f"unknown durable-store region while source(s) {by_source} restrict residency",
                    sources=restricting_ids,
                    labels=("residency_regions",),
                )
            return _Outcome(
                True, "store region unknown; every source is residency-unrestricted (PUBLIC)"
            )
        if allowed is not None and region not in allowed:
            excluding = tuple(
                source_id for source_id, regions in restricting if region not in regions
            )
            return _Outcome(
                False,
                f"store region {region!r} is outside the residency of source(s) "
                f"{_quoted(excluding)} (composed residency: {_listed(allowed)})",
                sources=excluding,
                labels=("residency_regions",),
            )
        if region not in authority.regions:
            return _Outcome(
                False,
                f"store region {region!r} is outside the effective authority's regions "
                f"({_listed(authority.regions)})",
            )
        scope = "unrestricted" if allowed is None else _listed(allowed)
        return _Outcome(
            True,
            f"store region {region!r} is within residency ({scope}) and the authority's regions",
        )

    def _retention(self, state: _Evaluation) -> _Outcome:
        composed = _known(state.composed)
        days = composed.retention_days
        if days is None:
            return _Outcome(True, "no retention limit (every source PUBLIC-derived)")
        if days == 0:
            forbidding = tuple(
                c.source_id
                for c in state.contributions
                if c.labels is not None and c.labels.retention_days == 0
            )
            return _Outcome(
                False,
                f"retention of 0 days forbids keeping a copy: source(s) {_quoted(forbidding)}",
                sources=forbidding,
                labels=("retention_days",),
            )
        state.retention_expiry = state.evaluated_at + days * _SECONDS_PER_DAY
        until = datetime.fromtimestamp(state.retention_expiry, tz=timezone.utc).isoformat(
            timespec="seconds"
        )
        return _Outcome(True, f"retain {days} day(s), until {until}")

    def _permit_reason(self, state: _Evaluation) -> str:
        authority, composed = _known(state.authority), _known(state.composed)
        return (
            f"permitted: {authority.actor!r} may persist checkpoint "
            f"{state.request.checkpoint_id!r} of tenant {authority.tenant!r} "
            f"({len(state.contributions)} source(s), {composed.classification.value})"
        )


def _contribution(source_id: str, labels: object) -> SourceContribution:
    # Anything a resolver returns that is not a SourceLabels reads as unlabelled.
    return SourceContribution.of(source_id, labels if isinstance(labels, SourceLabels) else None)


def _known(value: _T | None) -> _T:
    if value is None:
        raise RuntimeError("gate check ran before the check that establishes its input")
    return value


def _listed(names: frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names)
