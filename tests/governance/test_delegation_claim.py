"""A delegate's session names its ceiling (#46 finding 6): the `delegations` claim lists the jti of
every delegation that caps it, root first, and such a session is refused without exactly that
chain. Before, the ceiling was voluntary: a delegate who left `delegation_tokens` out acted with
the full session authority (forget permitted with the ceiling left out, refused with it)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import jwt
import pytest
from governance_support import ACTOR, TENANT, DictResolver, full_labels, session_token

from kvci_plugin.governance import (
    FORGET_SCOPE,
    CredentialError,
    CredentialErrorReason,
    CredentialIssuer,
    CredentialVerifier,
    DerivedAuthorityGate,
    ForgetRefusedError,
    PersistenceRequest,
    authorize_forget,
    derive_effective_authority,
)

DELEGATOR = "bob"


def ceiling(
    issuer: CredentialIssuer,
    jti: str,
    *,
    delegator: str = DELEGATOR,
    delegate: str = ACTOR,
    scopes: tuple[str, ...] = ("kv:persist", "kv:read"),
) -> str:
    """A delegation `delegator` -> `delegate` whose ceiling withholds kv:forget."""
    return issuer.issue_delegation(
        tenant=TENANT,
        delegator=delegator,
        delegate=delegate,
        scopes=scopes,
        clearance="CONFIDENTIAL",
        markings=["pii", "finance"],
        regions=["eu", "us"],
        jti=jti,
    )


def raw_session(hmac_key: Path, **extra: Any) -> str:
    """A session signed by hand, as any identity provider would mint it (no kvci issuer)."""
    now = int(time.time())
    claims = {"kind": "session", "sub": ACTOR, "tenant": TENANT, "aud": "kvci",
              "scopes": ["kv:persist", "kv:read", FORGET_SCOPE], "clearance": "CONFIDENTIAL",
              "markings": ["pii", "finance"], "regions": ["eu", "us"], "policy_version": 7,
              "iat": now, "nbf": now, "exp": now + 600, "jti": uuid.uuid4().hex, **extra}
    return jwt.encode(claims, hmac_key.read_bytes(), algorithm="HS256")


def test_a_session_that_names_its_ceiling_is_refused_without_it(
        hmac_key: Path, issuer: CredentialIssuer, verifier: CredentialVerifier) -> None:
    delegation = ceiling(issuer, "d-1")
    session = raw_session(hmac_key, delegations=["d-1"])
    # With the ceiling: kv:forget is withheld.
    with pytest.raises(ForgetRefusedError, match="forget_scope"):
        authorize_forget(verifier, TENANT, session, [delegation])
    # Without it: refused as well, never the full session authority.
    with pytest.raises(ForgetRefusedError, match="verified_authority") as refused:
        authorize_forget(verifier, TENANT, session, [])
    assert "d-1" in str(refused.value)
    with pytest.raises(CredentialError) as error:
        derive_effective_authority(verifier, session)
    assert error.value.reason is CredentialErrorReason.UNRESOLVABLE_DELEGATION
    assert (
        error.value.credential == "delegation[0]"
    )  # the gate records it as an unresolvable ceiling


@pytest.mark.parametrize("presented", ["other", "extra_root", "reordered", "short"])
def test_the_chain_presented_must_be_the_chain_named(
        issuer: CredentialIssuer, verifier: CredentialVerifier, presented: str) -> None:
    root = ceiling(issuer, "d-root", delegator="carol", delegate=DELEGATOR)
    leaf = ceiling(issuer, "d-leaf")
    session = session_token(issuer, delegations=["d-root", "d-leaf"])
    chains = {
        "other": [root, ceiling(issuer, "d-other")],
        "extra_root": [ceiling(issuer, "d-new", delegator="dave", delegate="carol"), root, leaf],
        "reordered": [leaf, root],
        "short": [leaf],
    }
    with pytest.raises(CredentialError) as error:
        derive_effective_authority(verifier, session, chains[presented])
    assert error.value.reason is CredentialErrorReason.UNRESOLVABLE_DELEGATION
    authority = derive_effective_authority(verifier, session, [root, leaf])
    assert [hop.jti for hop in authority.delegation_chain] == ["d-root", "d-leaf"]


def test_the_issuer_names_the_ceiling_of_a_delegates_session(
        issuer: CredentialIssuer, verifier: CredentialVerifier) -> None:
    delegation = ceiling(issuer, "d-2")
    session = session_token(issuer, delegations=["d-2"])
    assert verifier.verify_session(session).delegations == ("d-2",)
    assert jwt.decode(session, options={"verify_signature": False})["delegations"] == ["d-2"]
    assert derive_effective_authority(verifier, session, [delegation]).scopes == {
        "kv:persist",
        "kv:read",
    }
    # A session naming no ceiling keeps working as before, with or without a voluntary one.
    plain = session_token(issuer)
    assert verifier.verify_session(plain).delegations == ()
    assert (
        derive_effective_authority(verifier, plain, [delegation]).delegation_chain[0].jti == "d-2"
    )


@pytest.mark.parametrize("claim", ["d-1", [], [""], [1], ["d"] * 9])
def test_a_malformed_delegations_claim_is_refused(
        hmac_key: Path, verifier: CredentialVerifier, claim: Any) -> None:
    with pytest.raises(CredentialError) as error:
        verifier.verify_session(raw_session(hmac_key, delegations=claim))
    assert error.value.reason is CredentialErrorReason.MALFORMED


def test_a_persist_of_a_delegates_session_without_its_ceiling_is_refused(
        issuer: CredentialIssuer, verifier: CredentialVerifier) -> None:
    gate = DerivedAuthorityGate(
        verifier, DictResolver({"doc": full_labels()}), durable_store_region="eu"
    )
    session = session_token(issuer, delegations=["d-3"])

    def request(delegations: list[str]) -> PersistenceRequest:
        return PersistenceRequest(
            checkpoint_id="ckpt-1",
            tenant=TENANT,
            trigger="agent",
            session_token=session,
            source_ids=["doc"],
            delegation_tokens=delegations,
        )

    refused = gate.evaluate(request([]))
    assert not refused.permitted and refused.failed_check == "verified_authority"
    assert "unresolvable delegation ceiling" in refused.reason and "d-3" in refused.reason
    assert gate.evaluate(request([ceiling(issuer, "d-3")])).permitted
