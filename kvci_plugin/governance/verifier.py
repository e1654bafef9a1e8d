"""Verifies session and delegation credentials (signed JWTs) against one pinned algorithm and
key."""

from __future__ import annotations

import sqlite3
from typing import Any, Literal, TypeVar

import jwt
from pydantic import ValidationError

from kvci_plugin.governance.credential_config import CredentialConfig
from kvci_plugin.governance.credential_error import CredentialError, CredentialErrorReason
from kvci_plugin.governance.credentials import DelegationCeiling, VerifiedSession
from kvci_plugin.governance.keys import load_verification_key
from kvci_plugin.governance.revocation import RevocationList

CredentialKind = Literal["session", "delegation"]
_Claims = TypeVar("_Claims", VerifiedSession, DelegationCeiling)

_COMMON_CLAIMS = ("exp", "nbf", "aud", "jti", "kind")
_SESSION_CLAIMS = ("sub", "tenant", "scopes", "clearance", "markings", "regions", "policy_version")
# Optional on a session: the jti of every delegation that caps it, root first (a delegate's
# session).
_SESSION_DELEGATIONS = "delegations"
_DELEGATION_CLAIMS = ("tenant", "delegator", "delegate", "ceiling")
_CEILING_CLAIMS = ("scopes", "clearance", "markings", "regions")

# Most specific first: several PyJWT errors subclass DecodeError / InvalidTokenError.
_PYJWT_REASONS: tuple[tuple[type[Exception], CredentialErrorReason], ...] = (
    (jwt.ExpiredSignatureError, CredentialErrorReason.EXPIRED),
    (jwt.ImmatureSignatureError, CredentialErrorReason.NOT_YET_VALID),
    (jwt.InvalidAudienceError, CredentialErrorReason.BAD_AUDIENCE),
    (jwt.InvalidIssuerError, CredentialErrorReason.BAD_ISSUER),
    (jwt.InvalidSignatureError, CredentialErrorReason.BAD_SIGNATURE),
    (jwt.InvalidAlgorithmError, CredentialErrorReason.BAD_ALGORITHM),
    (jwt.MissingRequiredClaimError, CredentialErrorReason.MISSING_CLAIM),
    (jwt.PyJWTError, CredentialErrorReason.MALFORMED),
)


class CredentialVerifier:
    """Checks signature, algorithm, audience, issuer, exp/nbf, claims, kind and revocation.

    Nothing is cached: every call re-reads the revocation list, so a credential revoked or
    expired since the last call is refused by the next one.
    """

    def __init__(self, config: CredentialConfig, revocations: RevocationList | None = None) -> None:
        self.config = config
        self.revocations = revocations
        # Loaded once so that a bad key file fails at start-up, not on the first persist.
        self._key = load_verification_key(config.algorithm, config.key_file)
        self._jwt = jwt.PyJWT(options={"enforce_minimum_key_length": True})

    def verify_session(self, token: str) -> VerifiedSession:
        claims = self._decode(token, "session", _SESSION_CLAIMS)
        delegations = claims.get(_SESSION_DELEGATIONS)
        if delegations is not None and (not isinstance(delegations, list) or not delegations):
            # Named, it must name something: an empty or scalar claim is a minting error.
            raise CredentialError(CredentialErrorReason.MALFORMED,
                                  f"claim {_SESSION_DELEGATIONS!r} must be a non-empty list of "
                                  "delegation jti", "session")
        session = _build(
            "session",
            VerifiedSession,
            actor=claims["sub"],
            tenant=claims["tenant"],
            scopes=claims["scopes"],
            clearance=claims["clearance"],
            markings=claims["markings"],
            regions=claims["regions"],
            policy_version=claims["policy_version"],
            jti=claims["jti"],
            not_before=claims["nbf"],
            expires_at=claims["exp"],
            delegations=tuple(delegations or ()),
        )
        self._check_not_revoked("session", session.jti)
        return session

    def verify_delegation(self, token: str) -> DelegationCeiling:
        claims = self._decode(token, "delegation", _DELEGATION_CLAIMS)
        ceiling = claims["ceiling"]
        if not isinstance(ceiling, dict):
            raise CredentialError(
                CredentialErrorReason.MALFORMED, "claim 'ceiling' must be an object", "delegation"
            )
        _require("delegation", ceiling, _CEILING_CLAIMS, prefix="ceiling.")
        delegation = _build(
            "delegation",
            DelegationCeiling,
            jti=claims["jti"],
            tenant=claims["tenant"],
            delegator=claims["delegator"],
            delegate=claims["delegate"],
            scopes=ceiling["scopes"],
            clearance=ceiling["clearance"],
            markings=ceiling["markings"],
            regions=ceiling["regions"],
            not_before=claims["nbf"],
            expires_at=claims["exp"],
        )
        self._check_not_revoked("delegation", delegation.jti)
        return delegation

    def _decode(
        self, token: str, kind: CredentialKind, kind_claims: tuple[str, ...]
    ) -> dict[str, Any]:
        if not isinstance(token, str) or not token:
            raise CredentialError(
                CredentialErrorReason.MALFORMED, "credential must be a non-empty string", kind
            )
        required = [*_COMMON_CLAIMS, *(("iss",) if self.config.issuer is not None else ())]
        try:
            claims = self._jwt.decode(
                token,
                self._key,
                algorithms=[self.config.algorithm],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=self.config.leeway_s,
                options={"require": required},
            )
        except jwt.PyJWTError as exc:
            reason = next(reason for error, reason in _PYJWT_REASONS if isinstance(exc, error))
            raise CredentialError(reason, str(exc), kind) from exc
        if claims["kind"] != kind:
            raise CredentialError(
                CredentialErrorReason.WRONG_KIND,
                f"expected a {kind} credential, got kind {claims['kind']!r}",
                kind,
            )
        _require(kind, claims, kind_claims)
        return claims

    def _check_not_revoked(self, kind: CredentialKind, jti: str) -> None:
        if self.revocations is None:
            return
        try:
            reason = self.revocations.reason(jti)
        except (sqlite3.Error, OSError) as exc:
            # An unreadable revocation list must refuse, never read as "nothing revoked".
            raise CredentialError(
                CredentialErrorReason.REVOCATION_UNAVAILABLE,
                f"cannot read the revocation list: {exc}",
                kind,
            ) from exc
        if reason is not None:
            raise CredentialError(
                CredentialErrorReason.REVOKED, f"jti {jti!r} was revoked: {reason}", kind
            )


def _require(
    kind: CredentialKind, claims: dict[str, Any], names: tuple[str, ...], prefix: str = ""
) -> None:
    # Same rule as PyJWT's `require`: a claim set to null is as absent as a missing one.
    missing = [prefix + name for name in names if claims.get(name) is None]
    if missing:
        raise CredentialError(
            CredentialErrorReason.MISSING_CLAIM,
            f"missing required claim(s): {', '.join(missing)}",
            kind,
        )


def _build(kind: CredentialKind, model: type[_Claims], **fields: Any) -> _Claims:
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise CredentialError(
            CredentialErrorReason.MALFORMED, f"invalid claims: {problems}", kind
        ) from exc
