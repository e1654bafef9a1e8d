"""Mints session and delegation credentials (for the demo, the command line and tests)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jwt

from kvci_plugin.governance.classification import Classification
from kvci_plugin.governance.credential_config import CredentialAlgorithm
from kvci_plugin.governance.credentials import PolicyVersion
from kvci_plugin.governance.keys import load_signing_key


class CredentialIssuer:
    """Signs credentials with one algorithm and key; `CredentialVerifier` checks them.

    `now` and `not_before` are parameters so that a credential valid only in the past or the
    future can be minted without waiting for the clock.
    """

    def __init__(
        self,
        algorithm: CredentialAlgorithm,
        signing_key: Any,
        *,
        audience: str = "kvci",
        issuer: str | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.audience = audience
        self.issuer = issuer
        self._key = signing_key

    @classmethod
    def from_key_file(
        cls,
        algorithm: CredentialAlgorithm,
        key_file: Path,
        *,
        audience: str = "kvci",
        issuer: str | None = None,
    ) -> CredentialIssuer:
        """An issuer keyed by `key_file`: the HMAC secret for HS256, a PEM private key otherwise."""
        return cls(
            algorithm, load_signing_key(algorithm, key_file), audience=audience, issuer=issuer
        )

    def issue_session(
        self,
        *,
        actor: str,
        tenant: str,
        scopes: Iterable[str],
        clearance: Classification | str,
        markings: Iterable[str],
        regions: Iterable[str],
        policy_version: PolicyVersion,
        ttl_s: float = 3600.0,
        now: float | None = None,
        not_before: float | None = None,
        jti: str | None = None,
        delegations: Iterable[str] = (),
    ) -> str:
        """A session credential. A session issued to a delegate names the jti of every delegation
        that caps it, root first (`delegations`): the verifier refuses it without that chain."""
        named = list(delegations)
        return self._sign(
            {
                "kind": "session",
                "sub": actor,
                "tenant": tenant,
                "scopes": sorted(scopes),
                "clearance": _classification_name(clearance),
                "markings": sorted(markings),
                "regions": sorted(regions),
                "policy_version": policy_version,
                **({"delegations": named} if named else {}),
            },
            ttl_s=ttl_s,
            now=now,
            not_before=not_before,
            jti=jti,
        )

    def issue_delegation(
        self,
        *,
        tenant: str,
        delegator: str,
        delegate: str,
        scopes: Iterable[str],
        clearance: Classification | str,
        markings: Iterable[str],
        regions: Iterable[str],
        ttl_s: float = 3600.0,
        now: float | None = None,
        not_before: float | None = None,
        jti: str | None = None,
    ) -> str:
        return self._sign(
            {
                "kind": "delegation",
                "sub": delegate,
                "tenant": tenant,
                "delegator": delegator,
                "delegate": delegate,
                "ceiling": {
                    "scopes": sorted(scopes),
                    "clearance": _classification_name(clearance),
                    "markings": sorted(markings),
                    "regions": sorted(regions),
                },
            },
            ttl_s=ttl_s,
            now=now,
            not_before=not_before,
            jti=jti,
        )

    def _sign(
        self,
        claims: dict[str, Any],
        *,
        ttl_s: float,
        now: float | None,
        not_before: float | None,
        jti: str | None,
    ) -> str:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        issued = time.time() if now is None else now
        claims |= {
            "aud": self.audience,
            "iat": int(issued),
            "nbf": int(issued if not_before is None else not_before),
            "exp": int(issued + ttl_s),
            "jti": jti or uuid.uuid4().hex,
        }
        if self.issuer is not None:
            claims["iss"] = self.issuer
        return jwt.encode(claims, self._key, algorithm=self.algorithm)


def _classification_name(clearance: Classification | str) -> str:
    return (
        clearance if isinstance(clearance, Classification) else Classification.parse(clearance)
    ).value
