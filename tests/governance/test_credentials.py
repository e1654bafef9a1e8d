from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from governance_support import ACTOR, TENANT, session_token

from kvci_plugin.governance import (
    Classification,
    CredentialConfig,
    CredentialError,
    CredentialErrorReason,
    CredentialIssuer,
    CredentialVerifier,
    RevocationList,
    write_ed25519_key_pair,
    write_hmac_key_file,
)

Reason = CredentialErrorReason


def _raw_claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "kind": "session",
        "sub": ACTOR,
        "tenant": TENANT,
        "scopes": ["kv:persist"],
        "clearance": "INTERNAL",
        "markings": [],
        "regions": ["eu"],
        "policy_version": 1,
        "jti": "j-1",
        "aud": "kvci",
        "nbf": now,
        "exp": now + 600,
    }
    claims.update(overrides)
    return {key: value for key, value in claims.items() if value is not ...}


def _refusal(call: Any, *args: Any) -> CredentialError:
    with pytest.raises(CredentialError) as info:
        call(*args)
    return info.value


def test_session_claims_come_back_verified(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    token = session_token(issuer, jti="s-1", policy_version="2025-06")
    session = verifier.verify_session(token)
    assert session.actor == ACTOR
    assert session.tenant == TENANT
    assert session.scopes == {"kv:persist", "kv:read"}
    assert session.clearance is Classification.CONFIDENTIAL
    assert session.markings == {"pii", "finance"}
    assert session.regions == {"eu", "us"}
    assert session.policy_version == "2025-06"
    assert session.jti == "s-1"
    assert session.expires_at > time.time()


def test_delegation_ceiling_comes_back_verified(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    token = issuer.issue_delegation(
        tenant=TENANT,
        delegator="bob",
        delegate=ACTOR,
        scopes=["kv:persist"],
        clearance="INTERNAL",
        markings=["pii"],
        regions=["eu"],
        jti="d-1",
    )
    ceiling = verifier.verify_delegation(token)
    assert (ceiling.delegator, ceiling.delegate, ceiling.tenant, ceiling.jti) == (
        "bob",
        ACTOR,
        TENANT,
        "d-1",
    )
    assert ceiling.scopes == {"kv:persist"}
    assert ceiling.clearance is Classification.INTERNAL
    assert ceiling.markings == {"pii"}
    assert ceiling.regions == {"eu"}


def test_expired_session_is_refused(issuer: CredentialIssuer, verifier: CredentialVerifier) -> None:
    token = session_token(issuer, now=time.time() - 7200, ttl_s=3600)
    assert _refusal(verifier.verify_session, token).reason is Reason.EXPIRED


def test_leeway_tolerates_small_skew_only(issuer: CredentialIssuer, hmac_key: Path) -> None:
    token = session_token(issuer, now=time.time() - 3602, ttl_s=3600)  # expired 2 s ago
    lenient = CredentialVerifier(
        CredentialConfig(algorithm="HS256", key_file=hmac_key, leeway_s=30)
    )
    strict = CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=hmac_key, leeway_s=0))
    assert lenient.verify_session(token).actor == ACTOR
    assert _refusal(strict.verify_session, token).reason is Reason.EXPIRED


def test_session_not_yet_valid_is_refused(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    token = session_token(issuer, not_before=time.time() + 3600, ttl_s=7200)
    assert _refusal(verifier.verify_session, token).reason is Reason.NOT_YET_VALID


def test_wrong_audience_is_refused(hmac_key: Path, verifier: CredentialVerifier) -> None:
    other = CredentialIssuer.from_key_file("HS256", hmac_key, audience="another-service")
    assert _refusal(verifier.verify_session, session_token(other)).reason is Reason.BAD_AUDIENCE


def test_issuer_is_checked_when_configured(hmac_key: Path, issuer: CredentialIssuer) -> None:
    verifier = CredentialVerifier(
        CredentialConfig(algorithm="HS256", key_file=hmac_key, issuer="idp")
    )
    assert verifier.verify_session(
        session_token(CredentialIssuer.from_key_file("HS256", hmac_key, issuer="idp"))
    )
    wrong = CredentialIssuer.from_key_file("HS256", hmac_key, issuer="rogue")
    assert _refusal(verifier.verify_session, session_token(wrong)).reason is Reason.BAD_ISSUER
    absent = _refusal(verifier.verify_session, session_token(issuer))
    assert absent.reason is Reason.MISSING_CLAIM and "iss" in absent.detail


def test_token_signed_with_another_key_is_refused(
    tmp_path: Path, verifier: CredentialVerifier
) -> None:
    forger = CredentialIssuer.from_key_file("HS256", write_hmac_key_file(tmp_path / "other.key"))
    assert _refusal(verifier.verify_session, session_token(forger)).reason is Reason.BAD_SIGNATURE


def test_other_algorithms_are_refused(tmp_path: Path, verifier: CredentialVerifier) -> None:
    private, _ = write_ed25519_key_pair(tmp_path / "p.pem", tmp_path / "q.pem")
    eddsa = CredentialIssuer.from_key_file("EdDSA", private)
    assert _refusal(verifier.verify_session, session_token(eddsa)).reason is Reason.BAD_ALGORITHM
    unsigned = jwt.encode(_raw_claims(), None, algorithm="none")
    assert _refusal(verifier.verify_session, unsigned).reason is Reason.BAD_ALGORITHM


@pytest.mark.parametrize("token", ["", "not-a-jwt", "a.b.c"])
def test_garbage_is_malformed(verifier: CredentialVerifier, token: str) -> None:
    assert _refusal(verifier.verify_session, token).reason is Reason.MALFORMED


@pytest.mark.parametrize(
    ("claim", "value"),
    [
        ("clearance", "TOP_SECRET"),
        ("scopes", "kv:persist"),
        ("regions", [""]),
        ("policy_version", True),
        ("tenant", ""),
        # One tenant-name rule everywhere: a name the control surface could not forget, or a lone
        # surrogate that broke the scheduler, is refused where the credential is verified.
        ("tenant", "acme corp"),
        ("tenant", "acme\ud800"),
        ("tenant", "a" * 129),
    ],
)
def test_ill_typed_claims_are_malformed(
    hmac_key: Path, verifier: CredentialVerifier, claim: str, value: Any
) -> None:
    token = jwt.encode(_raw_claims(**{claim: value}), hmac_key.read_bytes(), algorithm="HS256")
    error = _refusal(verifier.verify_session, token)
    assert error.reason is Reason.MALFORMED
    assert claim in error.detail


@pytest.mark.parametrize(
    "claim", ["tenant", "scopes", "clearance", "markings", "regions", "policy_version", "sub"]
)
def test_each_session_claim_is_required(
    hmac_key: Path, verifier: CredentialVerifier, claim: str
) -> None:
    token = jwt.encode(_raw_claims(**{claim: ...}), hmac_key.read_bytes(), algorithm="HS256")
    error = _refusal(verifier.verify_session, token)
    assert error.reason is Reason.MISSING_CLAIM
    assert claim in error.detail


@pytest.mark.parametrize("claim", ["exp", "nbf", "aud", "jti", "kind"])
def test_each_standard_claim_is_required(
    hmac_key: Path, verifier: CredentialVerifier, claim: str
) -> None:
    token = jwt.encode(_raw_claims(**{claim: ...}), hmac_key.read_bytes(), algorithm="HS256")
    error = _refusal(verifier.verify_session, token)
    assert error.reason is Reason.MISSING_CLAIM
    assert claim in error.detail


@pytest.mark.parametrize("field", ["scopes", "clearance", "markings", "regions"])
def test_ceiling_without_an_axis_is_missing_a_claim(
    hmac_key: Path, verifier: CredentialVerifier, field: str
) -> None:
    ceiling = {"scopes": ["kv:persist"], "clearance": "INTERNAL", "markings": [], "regions": ["eu"]}
    del ceiling[field]
    claims = _raw_claims(kind="delegation", delegator="bob", delegate=ACTOR, ceiling=ceiling)
    error = _refusal(
        verifier.verify_delegation, jwt.encode(claims, hmac_key.read_bytes(), algorithm="HS256")
    )
    assert error.reason is Reason.MISSING_CLAIM
    assert f"ceiling.{field}" in error.detail


def test_credential_of_the_wrong_kind_is_refused(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    delegation = issuer.issue_delegation(
        tenant=TENANT,
        delegator="bob",
        delegate=ACTOR,
        scopes=[],
        clearance="PUBLIC",
        markings=[],
        regions=[],
    )
    assert _refusal(verifier.verify_session, delegation).reason is Reason.WRONG_KIND
    assert _refusal(verifier.verify_delegation, session_token(issuer)).reason is Reason.WRONG_KIND


def test_revoked_credential_is_refused_with_its_reason(
    issuer: CredentialIssuer, verifier: CredentialVerifier, revocations: RevocationList
) -> None:
    token = session_token(issuer, jti="s-revoke")
    assert verifier.verify_session(token).jti == "s-revoke"
    revocations.revoke("s-revoke", "laptop stolen")
    error = _refusal(verifier.verify_session, token)
    assert error.reason is Reason.REVOKED
    assert "laptop stolen" in error.detail


def test_unreadable_revocation_list_refuses(
    issuer: CredentialIssuer, verifier: CredentialVerifier, revocations: RevocationList
) -> None:
    revocations.path.write_bytes(b"this is not a sqlite database" * 100)
    assert (
        _refusal(verifier.verify_session, session_token(issuer)).reason
        is Reason.REVOCATION_UNAVAILABLE
    )


def test_eddsa_credentials_round_trip(tmp_path: Path) -> None:
    private, public = write_ed25519_key_pair(tmp_path / "p.pem", tmp_path / "q.pem")
    issuer = CredentialIssuer.from_key_file("EdDSA", private)
    verifier = CredentialVerifier(CredentialConfig(algorithm="EdDSA", key_file=public))
    assert verifier.verify_session(session_token(issuer)).actor == ACTOR
    # Same claims, different private key: the pinned public key refuses it.
    other, _ = write_ed25519_key_pair(tmp_path / "p2.pem", tmp_path / "q2.pem")
    forged = session_token(CredentialIssuer.from_key_file("EdDSA", other))
    assert _refusal(verifier.verify_session, forged).reason is Reason.BAD_SIGNATURE


def test_rs256_credentials_round_trip(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = tmp_path / "rsa.pem", tmp_path / "rsa.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    os.chmod(private, 0o600)
    os.chmod(public, 0o644)
    issuer = CredentialIssuer.from_key_file("RS256", private)
    verifier = CredentialVerifier(CredentialConfig(algorithm="RS256", key_file=public))
    assert verifier.verify_session(session_token(issuer)).tenant == TENANT


def test_issuer_rejects_unknown_clearance_and_bad_ttl(issuer: CredentialIssuer) -> None:
    with pytest.raises(ValueError, match="unknown classification 'SECRET'"):
        session_token(issuer, clearance="SECRET")
    with pytest.raises(ValueError, match="ttl_s"):
        session_token(issuer, ttl_s=0)
