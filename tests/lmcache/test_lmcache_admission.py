"""The admission decision: worthiness, triggers, the client's own skip, and the eligibility gate.

Real credentials (HS256 key file, signed JWTs), a real SQLite label catalog and kvci's real
DerivedAuthorityGate; nothing here needs LMCache to run, but the decisions are the ones the
facade writes into LMCache's request configs (see test_lmcache_plumbing / _scheduler).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvci_plugin.governance import (
    AlwaysDenyEligibility,
    CatalogLabelResolver,
    CredentialConfig,
    CredentialIssuer,
    CredentialVerifier,
    DerivedAuthorityGate,
    SourceLabels,
    set_persistence_eligibility_gate,
    write_hmac_key_file,
)
from kvci_plugin.lmcache.admission import AdmissionPolicy
from kvci_plugin.lmcache.config import KVCILMCacheConfig
from kvci_plugin.lmcache.decision import DECIDED_AT
from kvci_plugin.lmcache.gated_tiers import GatedTiers
from kvci_plugin.request.tenancy import TenantResolver

DISK = GatedTiers(local_disk=True)
# An observation the advisor finds worth a disk copy: long, reused, stable.
DISK_WORTHY = {"sibling_tasks": 4, "queued_tasks": 4, "turns_since_change": 5,
               "context_rewrites": 0, "context_evictions": 0}


@pytest.fixture(scope="module")
def issuer_and_verifier(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[CredentialIssuer, CredentialVerifier]:
    key = write_hmac_key_file(tmp_path_factory.mktemp("keys") / "hs256.key")
    return (CredentialIssuer.from_key_file("HS256", key),
            CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=key), None))


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> CatalogLabelResolver:
    resolver = CatalogLabelResolver(tmp_path_factory.mktemp("labels") / "labels.db")
    resolver.set_labels(
        "wiki", SourceLabels(classification="PUBLIC", mandatory_markings=frozenset())
    )
    resolver.set_labels(
        "crm",
        SourceLabels(
            classification="INTERNAL",
            residency_regions=frozenset({"eu"}),
            retention_days=30,
            mandatory_markings=frozenset(),
        ),
    )
    return resolver


@pytest.fixture
def derived_gate(issuer_and_verifier, catalog) -> Iterator[None]:
    previous = set_persistence_eligibility_gate(
        DerivedAuthorityGate(issuer_and_verifier[1], catalog, durable_store_region="eu"))
    yield
    set_persistence_eligibility_gate(previous)


@pytest.fixture
def deny_gate() -> Iterator[None]:
    previous = set_persistence_eligibility_gate(AlwaysDenyEligibility())
    yield
    set_persistence_eligibility_gate(previous)


def _policy(
    verifier: CredentialVerifier | None = None, tiers: GatedTiers = DISK, **config: Any
) -> AdmissionPolicy:
    return AdmissionPolicy(KVCILMCacheConfig(**config), TenantResolver(verifier), tiers)


def _session(
    issuer: CredentialIssuer, tenant: str = "acme", scopes: tuple[str, ...] = ("kv:persist",)
) -> str:
    return issuer.issue_session(actor="alice", tenant=tenant, scopes=scopes, clearance="INTERNAL",
                                markings=(), regions=("eu",), policy_version=1)


def _kvci(**fields: Any) -> dict[str, Any]:
    return {"kvci": {"session_id": "s-1", **fields}}


@settings(max_examples=60, deadline=None)
@given(prompt_tokens=st.integers(0, 400_000))
def test_unannotated_requests_are_saved_exactly_when_worth_keeping(prompt_tokens: int):
    decision = _policy().decide("r", None, prompt_tokens)
    assert decision.recommendation is not None
    assert decision.save is decision.recommendation.worth_it
    assert decision.trigger == ("system" if decision.save else None)
    assert not decision.durable and not decision.client_asked


def test_a_short_prompt_is_not_saved_and_a_long_one_is():
    assert not _policy().decide("r", None, 16).save
    assert _policy().decide("r", None, 200_000).save


@settings(max_examples=40, deadline=None)
@given(prompt_tokens=st.integers(0, 400_000))
def test_with_the_system_trigger_off_nothing_is_saved_unasked(prompt_tokens: int):
    assert not _policy(system_trigger=False).decide("r", _kvci(), prompt_tokens).save


@pytest.mark.parametrize("trigger", ["user", "agent"])
def test_an_explicit_trigger_saves_what_the_scorers_find_worthless(trigger: str):
    decision = _policy(system_trigger=False).decide(
        "r", _kvci(checkpoint="now", trigger=trigger), 16
    )
    assert decision.recommendation is not None and not decision.recommendation.worth_it
    assert decision.save and decision.trigger == trigger
    assert any(f"explicit {trigger} trigger" in reason for reason in decision.reasons)


@pytest.mark.parametrize("skip", [True, 1, "yes"])
def test_the_clients_own_skip_save_always_wins(skip: Any):
    params = {**_kvci(checkpoint="now"), "lmcache.skip_save": skip}
    decision = _policy().decide("r", params, 200_000)
    assert not decision.save and not decision.durable
    assert any("lmcache.skip_save" in reason for reason in decision.reasons)


def test_checkpoint_never_saves_nothing_however_worthy():
    decision = _policy(auto_promote=True).decide(
        "r", _kvci(checkpoint="never", observation=DISK_WORTHY), 200_000
    )
    assert decision.recommendation is not None and decision.recommendation.worth_it
    assert not decision.save and not decision.durable and decision.persist is None
    assert any("checkpoint 'never'" in reason for reason in decision.reasons)


@pytest.mark.parametrize(("params", "error"), [
    (_kvci(bogus=1), "bogus"),
    (_kvci(checkpoint="never", persist=True), "checkpoint 'never'"),
    ({"kvci": "now"}, "must be an object"),
    (_kvci(session_token="x.y.z"), "verifies no credentials"),
    (_kvci(observation={"retrieved_items": 1, "novel_items": 2}), "invalid observation"),
])
def test_rejected_kvci_params_save_nothing_and_say_why(params: dict[str, Any], error: str):
    decision = _policy().decide("r", params, 200_000)
    assert decision.error is not None and error in decision.error
    assert not decision.save and decision.client_asked
    reply = decision.reply()
    assert error in reply["error"] and reply["save"] is False and reply["decided_at"] == DECIDED_AT


def test_the_reply_carries_the_recommendation_and_reasons():
    reply = _policy().decide("r", _kvci(checkpoint="now"), 200_000).reply()
    assert reply["decided_at"] == DECIDED_AT
    assert reply["save"] is True and reply["durable"] is False and reply["trigger"] == "user"
    assert reply["recommendation"]["tier"] == "ram"
    assert reply["advisory"].startswith("KV-CHECKPOINT ADVISORY")
    assert any("decided at admission" in reason for reason in reply["reasons"])


def test_persist_is_refused_by_the_default_deny_gate(deny_gate):
    decision = _policy().decide("r", _kvci(persist=True, source_ids=["wiki"]), 100)
    assert decision.save and not decision.durable
    assert decision.persist is not None and decision.persist.failed_check == "always_deny"
    assert any("always_deny" in reason for reason in decision.reasons)


def test_a_permit_with_a_retention_limit_goes_to_the_gated_disk(derived_gate, issuer_and_verifier):
    issuer, verifier = issuer_and_verifier
    params = _kvci(session_token=_session(issuer), persist=True, source_ids=["crm"])
    decision = _policy(verifier).decide("r", params, 100)
    assert decision.persist is not None and decision.persist.permitted
    assert decision.durable and decision.tenant == "acme"
    assert decision.retention_expiry == decision.persist.retention_expiry is not None
    assert decision.persist.checkpoint_id == "lmcache:r"


def test_a_permit_with_a_retention_limit_is_not_durable_on_the_remote_tier_alone(
    derived_gate, issuer_and_verifier
):
    issuer, verifier = issuer_and_verifier
    params = _kvci(session_token=_session(issuer), persist=True, source_ids=["crm"])
    decision = _policy(verifier, tiers=GatedTiers(remote=True)).decide("r", params, 100)
    assert decision.persist is not None and decision.persist.permitted
    assert decision.save and not decision.durable and decision.retention_expiry is None
    assert any(
        "remote tier keeps only copies without a retention limit" in r for r in decision.reasons
    )


def test_a_public_permit_goes_to_the_remote_tier(derived_gate, issuer_and_verifier):
    issuer, verifier = issuer_and_verifier
    params = _kvci(session_token=_session(issuer), persist=True, source_ids=["wiki"])
    decision = _policy(verifier, tiers=GatedTiers(remote=True)).decide("r", params, 100)
    assert decision.durable and decision.retention_expiry is None


def test_a_permit_without_any_gated_tier_is_not_durable(derived_gate, issuer_and_verifier):
    issuer, verifier = issuer_and_verifier
    params = _kvci(session_token=_session(issuer), persist=True, source_ids=["wiki"])
    decision = _policy(verifier, tiers=GatedTiers()).decide("r", params, 100)
    assert decision.persist is not None and decision.persist.permitted and not decision.durable
    assert any("no gated durable tier" in reason for reason in decision.reasons)


def test_the_gate_names_the_check_that_refused(derived_gate, issuer_and_verifier):
    issuer, verifier = issuer_and_verifier
    params = _kvci(
        session_token=_session(issuer, scopes=("kv:read",)), persist=True, source_ids=["crm"]
    )
    decision = _policy(verifier).decide("r", params, 100)
    assert decision.save and not decision.durable
    assert decision.persist is not None and decision.persist.failed_check == "durable_write_scope"


def test_the_tenant_comes_from_the_verified_session(issuer_and_verifier):
    issuer, verifier = issuer_and_verifier
    assert (
        _policy(verifier).decide("r", _kvci(session_token=_session(issuer, "globex")), 100).tenant
        == "globex"
    )
    mismatch = _policy(verifier).decide(
        "r", _kvci(tenant="acme", session_token=_session(issuer, "globex")), 100
    )
    assert mismatch.error is not None and "disagrees" in mismatch.error


@pytest.mark.parametrize("auto_promote", [False, True])
def test_the_system_trigger_asks_the_gate_only_with_auto_promote(deny_gate, auto_promote: bool):
    decision = _policy(auto_promote=auto_promote).decide(
        "r", _kvci(observation=DISK_WORTHY), 200_000
    )
    assert decision.recommendation is not None and decision.recommendation.tier.value == "disk"
    assert decision.save and decision.trigger == "system"
    assert (decision.persist is not None) is auto_promote


_client_params = st.fixed_dictionaries(
    {"session_id": st.just("s-1")},
    optional={
        "tenant": st.sampled_from(["acme", "globex"]),
        "checkpoint": st.sampled_from(["now", "never"]),
        "persist": st.booleans(),
        "trigger": st.sampled_from(["user", "agent"]),
        "source_ids": st.lists(st.sampled_from(["wiki", "crm", "unknown"]), max_size=3),
        "observation": st.fixed_dictionaries({}, optional={
            "tool_calls": st.integers(0, 50), "sibling_tasks": st.integers(0, 8),
            "turns_since_change": st.integers(0, 8), "context_rewrites": st.integers(0, 3)}),
    })


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kvci=st.none() | _client_params, skip=st.sampled_from([None, True, False]),
       with_token=st.booleans(), prompt_tokens=st.integers(0, 300_000),
       tiers=st.sampled_from([GatedTiers(), DISK, GatedTiers(remote=True)]))
def test_decisions_never_widen(
    derived_gate, issuer_and_verifier, kvci, skip, with_token, prompt_tokens, tiers
):
    issuer, verifier = issuer_and_verifier
    params: dict[str, Any] = {}
    if kvci is not None:
        params["kvci"] = {**kvci, **({"session_token": _session(issuer)} if with_token else {})}
    if skip is not None:
        params["lmcache.skip_save"] = skip
    decision = _policy(verifier, tiers=tiers).decide("r", params, prompt_tokens)
    if skip or (kvci is not None and kvci.get("checkpoint") == "never"):
        assert not decision.save
    if decision.durable:
        assert decision.save and decision.persist is not None and decision.persist.permitted
        assert tiers.accepting(decision.retention_expiry)
    if decision.persist is not None:
        # The gate is asked only for what a client asked to persist, or auto_promote (off here).
        assert kvci is not None and kvci.get("persist")
    assert decision.client_asked is (kvci is not None)
