from __future__ import annotations

import time

import pytest
from governance_support import ACTOR, TENANT, session_token
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.governance import (
    Classification,
    CredentialError,
    CredentialErrorReason,
    CredentialIssuer,
    CredentialVerifier,
    EffectiveAuthority,
    RevocationList,
    derive_effective_authority,
)


def _delegation(
    issuer: CredentialIssuer, delegator: str, delegate: str, **overrides: object
) -> str:
    claims: dict[str, object] = {
        "tenant": TENANT,
        "delegator": delegator,
        "delegate": delegate,
        "scopes": ["kv:persist", "kv:read", "kv:admin"],
        "clearance": "RESTRICTED",
        "markings": ["pii", "finance", "hr"],
        "regions": ["eu", "us", "apac"],
    }
    claims.update(overrides)
    return issuer.issue_delegation(**claims)  # type: ignore[arg-type]


def test_without_delegation_authority_is_the_session(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    authority = derive_effective_authority(verifier, session_token(issuer, jti="s-1"))
    assert (authority.actor, authority.tenant, authority.session_jti) == (ACTOR, TENANT, "s-1")
    assert authority.scopes == {"kv:persist", "kv:read"}
    assert authority.clearance is Classification.CONFIDENTIAL
    assert authority.markings == {"pii", "finance"}
    assert authority.regions == {"eu", "us"}
    assert authority.policy_version == 7
    assert authority.delegation_chain == ()


def test_ceiling_intersects_every_axis(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    ceiling = _delegation(
        issuer,
        "bob",
        ACTOR,
        scopes=["kv:read", "kv:admin"],
        clearance="INTERNAL",
        markings=["pii", "hr"],
        regions=["us"],
    )
    authority = derive_effective_authority(verifier, session_token(issuer), [ceiling])
    assert authority.scopes == {
        "kv:read"
    }  # kv:admin was never the session's: a ceiling adds nothing
    assert authority.clearance is Classification.INTERNAL
    assert authority.markings == {"pii"}
    assert authority.regions == {"us"}
    assert [(hop.delegator, hop.delegate) for hop in authority.delegation_chain] == [("bob", ACTOR)]


def test_chain_links_root_to_leaf(issuer: CredentialIssuer, verifier: CredentialVerifier) -> None:
    root = _delegation(issuer, "carol", "bob", regions=["eu"])
    leaf = _delegation(issuer, "bob", ACTOR, clearance="INTERNAL")
    authority = derive_effective_authority(verifier, session_token(issuer), [root, leaf])
    assert authority.regions == {"eu"} and authority.clearance is Classification.INTERNAL
    with pytest.raises(CredentialError) as info:
        derive_effective_authority(verifier, session_token(issuer), [leaf, root])
    assert info.value.reason is CredentialErrorReason.UNRESOLVABLE_DELEGATION
    assert info.value.credential == "delegation[1]"


def test_chain_must_end_at_the_session_actor(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    with pytest.raises(CredentialError) as info:
        derive_effective_authority(
            verifier, session_token(issuer), [_delegation(issuer, "bob", "mallory")]
        )
    assert info.value.reason is CredentialErrorReason.UNRESOLVABLE_DELEGATION
    assert "mallory" in info.value.detail and ACTOR in info.value.detail


def test_ceiling_of_another_tenant_is_unresolvable(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    with pytest.raises(CredentialError) as info:
        derive_effective_authority(
            verifier, session_token(issuer), [_delegation(issuer, "bob", ACTOR, tenant="globex")]
        )
    assert info.value.reason is CredentialErrorReason.UNRESOLVABLE_DELEGATION
    assert "globex" in info.value.detail


def test_expired_or_revoked_hop_names_itself(
    issuer: CredentialIssuer, verifier: CredentialVerifier, revocations: RevocationList
) -> None:
    root = _delegation(issuer, "carol", "bob", jti="d-root")
    stale = _delegation(issuer, "bob", ACTOR, now=time.time() - 7200, ttl_s=60)
    with pytest.raises(CredentialError) as info:
        derive_effective_authority(verifier, session_token(issuer), [root, stale])
    assert (info.value.reason, info.value.credential) == (
        CredentialErrorReason.EXPIRED,
        "delegation[1]",
    )

    revocations.revoke("d-root", "carol left")
    with pytest.raises(CredentialError) as info:
        derive_effective_authority(
            verifier, session_token(issuer), [root, _delegation(issuer, "bob", ACTOR)]
        )
    assert (info.value.reason, info.value.credential) == (
        CredentialErrorReason.REVOKED,
        "delegation[0]",
    )


def test_session_failure_names_the_session(
    issuer: CredentialIssuer, verifier: CredentialVerifier
) -> None:
    with pytest.raises(CredentialError) as info:
        derive_effective_authority(
            verifier, session_token(issuer, now=time.time() - 7200, ttl_s=60)
        )
    assert (info.value.reason, info.value.credential) == (CredentialErrorReason.EXPIRED, "session")


_scopes = st.frozensets(st.sampled_from(["kv:persist", "kv:read", "kv:admin"]))
_markings = st.frozensets(st.sampled_from(["pii", "finance", "hr"]))
_regions = st.frozensets(st.sampled_from(["eu", "us", "apac"]))
_ceiling = st.fixed_dictionaries(
    {
        "scopes": _scopes,
        "clearance": st.sampled_from(Classification),
        "markings": _markings,
        "regions": _regions,
    }
)


def _covered_by(narrow: EffectiveAuthority, wide: EffectiveAuthority) -> bool:
    return (
        narrow.scopes <= wide.scopes
        and narrow.clearance <= wide.clearance
        and narrow.markings <= wide.markings
        and narrow.regions <= wide.regions
    )


@settings(max_examples=100, deadline=None)
@given(session=_ceiling, chain=st.lists(_ceiling, max_size=3), extra=_ceiling)
def test_adding_a_delegation_hop_never_widens_authority(
    issuer: CredentialIssuer,
    plain_verifier: CredentialVerifier,
    session: dict,
    chain: list[dict],
    extra: dict,
) -> None:
    names = [f"principal-{index}" for index in range(len(chain))] + [ACTOR]
    tokens = [
        _delegation(issuer, names[i], names[i + 1], **ceiling) for i, ceiling in enumerate(chain)
    ]
    extended = [_delegation(issuer, "new-root", names[0], **extra), *tokens]
    token = session_token(issuer, **session)

    before = derive_effective_authority(plain_verifier, token, tokens)
    after = derive_effective_authority(plain_verifier, token, extended)

    assert _covered_by(after, before)
    # And the result is exactly the intersection: the session capped by every ceiling.
    expected_scopes = frozenset(session["scopes"]).intersection(
        *(c["scopes"] for c in [extra, *chain])
    )
    assert after.scopes == expected_scopes
    assert after.clearance == min(
        [session["clearance"], extra["clearance"], *(c["clearance"] for c in chain)]
    )
    assert after.regions == frozenset(session["regions"]).intersection(
        *(c["regions"] for c in [extra, *chain])
    )
    assert after.markings == frozenset(session["markings"]).intersection(
        *(c["markings"] for c in [extra, *chain])
    )
