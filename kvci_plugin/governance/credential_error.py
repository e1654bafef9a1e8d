"""The one error a credential check raises, with a machine-readable reason."""

from __future__ import annotations

import enum


class CredentialErrorReason(str, enum.Enum):
    EXPIRED = "expired"
    NOT_YET_VALID = "not_yet_valid"
    BAD_AUDIENCE = "bad_audience"
    BAD_ISSUER = "bad_issuer"
    BAD_SIGNATURE = "bad_signature"
    BAD_ALGORITHM = "bad_algorithm"
    MALFORMED = "malformed"
    MISSING_CLAIM = "missing_claim"
    WRONG_KIND = "wrong_kind"
    REVOKED = "revoked"
    REVOCATION_UNAVAILABLE = "revocation_unavailable"
    UNRESOLVABLE_DELEGATION = "unresolvable_delegation"


class CredentialError(Exception):
    """A credential that cannot be trusted. `credential` names which one ("session",
    "delegation[0]")."""

    def __init__(
        self, reason: CredentialErrorReason, detail: str, credential: str = "credential"
    ) -> None:
        self.reason = reason
        self.detail = detail
        self.credential = credential
        super().__init__(f"{credential}: {reason.value}: {detail}")

    def for_credential(self, credential: str) -> CredentialError:
        """The same failure, attributed to a named credential."""
        return CredentialError(self.reason, self.detail, credential)
