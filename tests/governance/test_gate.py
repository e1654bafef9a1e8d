from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from governance_support import ACTOR, TENANT, DictResolver, full_labels, session_token

import kvci_plugin.governance as governance
from kvci_plugin.governance import (
    CHECK_ORDER,
    AlwaysDenyEligibility,
    CatalogLabelResolver,
    CredentialConfig,
    CredentialIssuer,
    CredentialVerifier,
    DerivedAuthorityGate,
    EligibilityDecision,
    PersistenceRequest,
    RevocationList,
    SourceLabels,
    get_persistence_eligibility_gate,
    get_source_label_resolver,
    set_persistence_eligibility_gate,
    set_source_label_resolver,
)


def _request(
    token: str | None, sources: Sequence[str] = ("doc",), **overrides: object
) -> PersistenceRequest:
    fields: dict[str, object] = {
        "checkpoint_id": "ckpt-1",
        "tenant": TENANT,
        "trigger": "agent",
        "session_token": token,
        "source_ids": list(sources),
    }
    fields.update(overrides)
    return PersistenceRequest.model_validate(fields)


def _gate(
    verifier: CredentialVerifier | None,
    labels: Mapping[str, SourceLabels | None],
    region: str | None = "eu",
) -> DerivedAuthorityGate:
    return DerivedAuthorityGate(verifier, DictResolver(labels), durable_store_region=region)


def _assert_refused_at(decision: EligibilityDecision, check: str) -> governance.CheckRecord:
    assert not decision.permitted
    assert decision.failed_check == check
    assert decision.reason.startswith(f"refused at {check}: ")
    index = CHECK_ORDER.index(check)
    assert [record.name for record in decision.derivation.checks] == list(CHECK_ORDER)
    assert [record.verdict for record in decision.derivation.checks] == (
        ["pass"] * index + ["fail"] + ["not_run"] * (len(CHECK_ORDER) - index - 1)
    )
    assert decision.retention_expiry is None
    return decision.derivation.checks[index]


def test_authority_that_dominates_the_labels_permits(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    decision = _gate(verifier, {"doc": full_labels(retention_days=30)}).evaluate(
        _request(session_token(issuer))
    )
    assert decision.permitted, decision.reason
    assert decision.failed_check is None
    assert [(r.name, r.verdict) for r in decision.derivation.checks] == [
        (name, "pass") for name in CHECK_ORDER
    ]
    assert decision.gate == "derived_authority"
    assert decision.retention_expiry == pytest.approx(decision.evaluated_at + 30 * 86_400)
    derivation = decision.derivation
    assert derivation.authority is not None and derivation.authority.actor == ACTOR
    assert derivation.composed_label is not None and derivation.composed_label.retention_days == 30
    assert [c.source_id for c in derivation.sources] == ["doc"]


@pytest.mark.parametrize(
    ("check", "session", "labels", "request_overrides", "named"),
    [
        ("tenancy", {}, {}, {"tenant": "globex"}, "globex"),
        ("durable_write_scope", {"scopes": ["kv:read"]}, {}, {}, "kv:persist"),
        ("classification", {}, {"classification": "RESTRICTED"}, {}, "doc"),
        ("mandatory_markings", {}, {"mandatory_markings": ["pii", "hr"]}, {}, "hr"),
        ("residency", {}, {"residency_regions": ["us"]}, {}, "doc"),
        ("retention", {}, {"retention_days": 0}, {}, "doc"),
    ],
)
def test_each_check_refuses_in_order_and_names_the_cause(
    issuer: CredentialIssuer,
    verifier: CredentialVerifier,
    check: str,
    session: dict,
    labels: dict,
    request_overrides: dict,
    named: str,
) -> None:
    gate = _gate(verifier, {"doc": full_labels(**labels)})
    record = _assert_refused_at(
        gate.evaluate(_request(session_token(issuer, **session), **request_overrides)), check
    )
    assert named in record.detail


def test_no_checked_session_refuses(verifier: CredentialVerifier) -> None:
    record = _assert_refused_at(
        _gate(verifier, {"doc": full_labels()}).evaluate(_request(None)), "verified_authority"
    )
    assert "no checked session" in record.detail


def test_no_verifier_refuses(issuer: CredentialIssuer) -> None:
    decision = _gate(None, {"doc": full_labels()}).evaluate(_request(session_token(issuer)))
    assert "no credential verifier" in _assert_refused_at(decision, "verified_authority").detail


def test_unverifiable_session_refuses_with_its_reason(
    tmp_path: Path, verifier: CredentialVerifier
) -> None:
    forged = session_token(
        CredentialIssuer.from_key_file("HS256", governance.write_hmac_key_file(tmp_path / "k"))
    )
    record = _assert_refused_at(
        _gate(verifier, {"doc": full_labels()}).evaluate(_request(forged)), "verified_authority"
    )
    assert "session not verified" in record.detail and "bad_signature" in record.detail


def test_no_declared_sources_refuses(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    decision = _gate(verifier, {"doc": full_labels()}).evaluate(
        _request(session_token(issuer), sources=())
    )
    assert "no declared sources" in _assert_refused_at(decision, "source_provenance").detail


@pytest.mark.parametrize("axis", governance.LABEL_AXES)
def test_a_source_missing_a_label_refuses_naming_source_and_label(
    issuer: CredentialIssuer, verifier: CredentialVerifier, axis: str
) -> None:
    labels = {"ok": full_labels(), "partial": full_labels().model_copy(update={axis: None})}
    decision = _gate(verifier, labels).evaluate(
        _request(session_token(issuer), sources=["ok", "partial"])
    )
    record = _assert_refused_at(decision, "labels_present")
    assert (record.sources, record.labels) == (("partial",), (axis,))
    assert f"source 'partial' lacks {axis}" in decision.reason


def test_an_unlabelled_source_refuses_naming_it(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    decision = _gate(verifier, {"ok": full_labels()}).evaluate(
        _request(session_token(issuer), sources=["ok", "mystery"])
    )
    record = _assert_refused_at(decision, "labels_present")
    assert record.sources == ("mystery",)
    assert set(record.labels) == set(governance.LABEL_AXES)
    assert "'mystery' is unlabelled or unreadable" in record.detail


def test_public_without_classification_loses_its_derivation(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    labels = {"pub": SourceLabels(mandatory_markings=[])}
    record = _assert_refused_at(
        _gate(verifier, labels).evaluate(_request(session_token(issuer), ["pub"])), "labels_present"
    )
    assert record.labels == ("classification", "residency_regions", "retention_days")


def test_empty_residency_intersection_refuses_naming_the_sources(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    labels = {
        "eu-only": full_labels(residency_regions=["eu"]),
        "us-only": full_labels(residency_regions=["us"]),
    }
    decision = _gate(verifier, labels).evaluate(
        _request(session_token(issuer), sources=["eu-only", "us-only"])
    )
    record = _assert_refused_at(decision, "residency")
    assert "empty residency intersection" in record.detail
    assert record.sources == ("eu-only", "us-only")


def test_unknown_store_region_refuses_where_a_source_restricts_residency(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    labels = {
        "pub": SourceLabels(classification="PUBLIC", mandatory_markings=[]),
        "eu": full_labels(residency_regions=["eu"]),
    }
    decision = _gate(verifier, labels, region=None).evaluate(
        _request(session_token(issuer), sources=["pub", "eu"])
    )
    record = _assert_refused_at(decision, "residency")
    assert "unknown durable-store region" in record.detail
    assert record.sources == ("eu",)


def test_public_sources_persist_anywhere_for_ever_and_the_decision_says_why(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    labels = {
        "a": SourceLabels(classification="PUBLIC", mandatory_markings=[]),
        "b": SourceLabels(classification="PUBLIC", mandatory_markings=[]),
    }
    decision = _gate(verifier, labels, region=None).evaluate(
        _request(session_token(issuer), sources=["a", "b"])
    )
    assert decision.permitted, decision.reason
    assert decision.retention_expiry is None
    assert decision.derivation.derived_axes == (
        "residency_regions: unrestricted (PUBLIC source 'a')",
        "retention_days: no limit (PUBLIC source 'a')",
        "residency_regions: unrestricted (PUBLIC source 'b')",
        "retention_days: no limit (PUBLIC source 'b')",
    )
    checks = {record.name: record.detail for record in decision.derivation.checks}
    assert "PUBLIC" in checks["residency"] and "PUBLIC" in checks["retention"]


def test_store_region_outside_the_authority_refuses(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    labels = {"doc": full_labels(residency_regions=["eu", "apac"])}
    decision = _gate(verifier, labels, region="apac").evaluate(_request(session_token(issuer)))
    assert "effective authority's regions" in _assert_refused_at(decision, "residency").detail


def test_request_region_must_match_the_guarded_store(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    gate = _gate(verifier, {"doc": full_labels()}, region="eu")
    decision = gate.evaluate(_request(session_token(issuer), durable_store_region="us"))
    assert "this gate guards 'eu'" in _assert_refused_at(decision, "residency").detail
    unconfigured = _gate(verifier, {"doc": full_labels()}, region=None)
    assert unconfigured.evaluate(
        _request(session_token(issuer), durable_store_region="eu")
    ).permitted


def _delegation(issuer: CredentialIssuer, **overrides: object) -> str:
    claims: dict[str, object] = {
        "tenant": TENANT,
        "delegator": "bob",
        "delegate": ACTOR,
        "scopes": ["kv:persist"],
        "clearance": "CONFIDENTIAL",
        "markings": ["pii"],
        "regions": ["eu"],
    }
    claims.update(overrides)
    return issuer.issue_delegation(**claims)  # type: ignore[arg-type]


def test_unresolvable_delegation_ceiling_refuses(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    gate = _gate(verifier, {"doc": full_labels()})
    for ceiling in (
        _delegation(issuer, delegate="mallory"),
        _delegation(issuer, tenant="globex"),
        "garbage",
    ):
        decision = gate.evaluate(_request(session_token(issuer), delegation_tokens=[ceiling]))
        record = _assert_refused_at(decision, "verified_authority")
        assert (
            "unresolvable delegation ceiling" in record.detail and "delegation[0]" in record.detail
        )


def test_delegation_ceiling_narrows_what_may_be_persisted(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    gate = _gate(verifier, {"doc": full_labels()})
    assert gate.evaluate(
        _request(session_token(issuer), delegation_tokens=[_delegation(issuer)])
    ).permitted
    withheld = gate.evaluate(
        _request(session_token(issuer), delegation_tokens=[_delegation(issuer, scopes=["kv:read"])])
    )
    assert (
        "withheld by delegation[0] ('bob' -> 'alice')"
        in _assert_refused_at(withheld, "durable_write_scope").detail
    )
    capped = gate.evaluate(
        _request(session_token(issuer), delegation_tokens=[_delegation(issuer, clearance="PUBLIC")])
    )
    _assert_refused_at(capped, "classification")


def test_session_expired_since_the_checkpoint_refuses_later(
    issuer: CredentialIssuer, hmac_key: Path, revocations: RevocationList
) -> None:
    verifier = CredentialVerifier(
        CredentialConfig(algorithm="HS256", key_file=hmac_key, leeway_s=0), revocations
    )
    expires = int(time.time()) + 2
    token = session_token(issuer, now=expires - 3600, ttl_s=3600)
    gate = _gate(verifier, {"doc": full_labels()})
    request = _request(token)
    assert gate.evaluate(request).permitted
    time.sleep(max(0.0, expires - time.time()) + 0.05)
    record = _assert_refused_at(gate.evaluate(request), "verified_authority")
    assert "expired" in record.detail


def test_delegation_revoked_since_the_checkpoint_refuses_later(
    issuer: CredentialIssuer, verifier: CredentialVerifier, revocations: RevocationList
) -> None:
    gate = _gate(verifier, {"doc": full_labels()})
    request = _request(session_token(issuer), delegation_tokens=[_delegation(issuer, jti="d-77")])
    assert gate.evaluate(request).permitted
    revocations.revoke("d-77", "bob withdrew consent")
    record = _assert_refused_at(gate.evaluate(request), "verified_authority")
    assert "revoked" in record.detail and "bob withdrew consent" in record.detail


@pytest.mark.parametrize("scopes", [["kv:persist"], ["kv:read"]])
def test_the_trigger_buys_nothing(
    issuer: CredentialIssuer, verifier: CredentialVerifier, scopes: list[str]
) -> None:
    gate = _gate(verifier, {"doc": full_labels()})
    token = session_token(issuer, scopes=scopes)
    decisions = [
        gate.evaluate(_request(token, trigger=trigger)) for trigger in ("system", "user", "agent")
    ]
    assert {d.permitted for d in decisions} == {scopes == ["kv:persist"]}
    assert {d.failed_check for d in decisions} == {
        None if scopes == ["kv:persist"] else "durable_write_scope"
    }
    assert len({d.derivation.checks for d in decisions}) == 1


def test_decisions_round_trip_through_json(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    gate = _gate(
        verifier,
        {"doc": full_labels(), "pub": SourceLabels(classification="PUBLIC", mandatory_markings=[])},
    )
    token = session_token(issuer, policy_version="p-3")
    permit = gate.evaluate(
        _request(token, sources=["doc", "pub"], delegation_tokens=[_delegation(issuer)])
    )
    refusal = gate.evaluate(_request(token, sources=["doc", "nope"]))
    for decision in (permit, refusal, AlwaysDenyEligibility().evaluate(_request(token))):
        text = decision.model_dump_json()
        restored = EligibilityDecision.model_validate_json(text)
        assert restored == decision
        assert restored.model_dump_json() == text
    assert permit.permitted and permit.derivation.delegation_chain[0].delegator == "bob"


def test_a_decision_cannot_claim_a_permit_with_a_failed_check() -> None:
    with pytest.raises(ValueError, match="failed check"):
        EligibilityDecision(
            permitted=True,
            gate="g",
            checkpoint_id="c",
            trigger="user",
            failed_check="tenancy",
            reason="r",
            derivation=governance.PersistenceDerivation(),
            evaluated_at=0.0,
        )
    with pytest.raises(ValueError, match="must name the check"):
        EligibilityDecision(
            permitted=False,
            gate="g",
            checkpoint_id="c",
            trigger="user",
            failed_check=None,
            reason="r",
            derivation=governance.PersistenceDerivation(),
            evaluated_at=0.0,
        )


class _OmittingResolver:
    def resolve(self, source_ids: Sequence[str],
                tenant: str | None = None) -> dict[str, SourceLabels | None]:
        return {source_id: full_labels() for source_id in source_ids[1:]}


class _FailingResolver:
    def resolve(self, source_ids: Sequence[str],
                tenant: str | None = None) -> dict[str, SourceLabels | None]:
        raise OSError("label service unreachable")


def test_a_resolver_that_omits_or_fails_refuses(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    request = _request(session_token(issuer), sources=["first", "second"])
    omitted = DerivedAuthorityGate(
        verifier, _OmittingResolver(), durable_store_region="eu"
    ).evaluate(request)
    record = _assert_refused_at(omitted, "source_provenance")
    assert record.sources == ("first",) and "never vanish" in record.detail
    failed = DerivedAuthorityGate(verifier, _FailingResolver(), durable_store_region="eu").evaluate(
        request
    )
    assert "label service unreachable" in _assert_refused_at(failed, "source_provenance").detail


def test_gate_without_resolver_reads_the_seam_at_each_evaluation(
    issuer: CredentialIssuer, verifier: CredentialVerifier, tmp_path: Path
) -> None:
    gate = DerivedAuthorityGate(verifier, durable_store_region="eu")
    request = _request(session_token(issuer))
    _assert_refused_at(
        gate.evaluate(request), "labels_present"
    )  # the shipped resolver labels nothing
    catalog = CatalogLabelResolver(tmp_path / "labels.db")
    catalog.set_labels("doc", full_labels())
    set_source_label_resolver(catalog)
    assert gate.evaluate(request).permitted


def test_shipped_defaults_deny(issuer: CredentialIssuer) -> None:
    gate = get_persistence_eligibility_gate()
    assert isinstance(gate, AlwaysDenyEligibility)
    decision = gate.evaluate(_request(session_token(issuer), trigger="user"))
    assert not decision.permitted and decision.failed_check == "always_deny"
    assert decision.gate == "always_deny" and "prohibits" in decision.reason
    assert get_source_label_resolver().resolve(["x"]) == {"x": None}


def test_seams_swap_and_return_the_previous(verifier: CredentialVerifier) -> None:
    gate = DerivedAuthorityGate(verifier)
    previous = set_persistence_eligibility_gate(gate)
    assert isinstance(previous, AlwaysDenyEligibility)
    assert get_persistence_eligibility_gate() is gate
    resolver = DictResolver({})
    set_source_label_resolver(resolver)
    assert get_source_label_resolver() is resolver


@pytest.mark.parametrize("bad", [None, object(), "always_deny"])
def test_seams_refuse_what_is_not_a_gate_or_resolver(bad: object) -> None:
    with pytest.raises(TypeError, match="PersistenceEligibilityGate"):
        set_persistence_eligibility_gate(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SourceLabelResolver"):
        set_source_label_resolver(bad)  # type: ignore[arg-type]
    assert isinstance(get_persistence_eligibility_gate(), AlwaysDenyEligibility)


def test_gate_arguments_are_validated(verifier: CredentialVerifier) -> None:
    with pytest.raises(TypeError, match="verifier"):
        DerivedAuthorityGate("key.pem")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="resolver"):
        DerivedAuthorityGate(verifier, {"doc": full_labels()})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="durable_store_region"):
        DerivedAuthorityGate(verifier, durable_store_region="")
    with pytest.raises(ValueError, match="required_scope"):
        DerivedAuthorityGate(verifier, required_scope="")


def test_request_validation() -> None:
    request = _request(
        "bearer-secret", sources=["a", "b", "a"], delegation_tokens=["delegated-secret"]
    )
    assert request.source_ids == ("a", "b")
    assert "secret" not in repr(request)
    with pytest.raises(ValueError, match="trigger"):
        _request("t", trigger="admin")
    with pytest.raises(ValueError, match="source_ids"):
        _request("t", sources=["a", ""])


def test_nothing_in_governance_reads_the_environment() -> None:
    # Persistence may only be widened by code through the seams, never by configuration.
    package = Path(governance.__file__).parent
    for source in package.glob("*.py"):
        assert not re.search(r"\benviron\b|\bgetenv\b", source.read_text()), source.name
