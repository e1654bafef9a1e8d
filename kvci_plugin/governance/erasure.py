"""Who may `forget` a tenant: crypto-erasure is gated like a persist, on verified authority.

A forget destroys a tenant's key material for every node, so it needs more than reaching the
control surface: a verified session credential of that very tenant whose effective authority
(the session intersected with every delegation ceiling, as at a promote) holds the
``kv:forget`` scope. Absence denies: no verifier, no credential, another tenant's credential or a
missing scope each refuse, naming the check.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvci_plugin.governance.authority import EffectiveAuthority, derive_effective_authority
from kvci_plugin.governance.credential_error import CredentialError
from kvci_plugin.governance.verifier import CredentialVerifier

FORGET_SCOPE = "kv:forget"


class ForgetRefusedError(Exception):
    """A forget the caller's authority does not allow; the message names the failed check and
    never a credential's text."""


def authorize_forget(
    verifier: CredentialVerifier | None,
    tenant: str,
    session_token: str | None,
    delegation_tokens: Sequence[str] = (),
) -> EffectiveAuthority:
    """The authority that permits forgetting ``tenant``; ``ForgetRefusedError`` otherwise."""
    if verifier is None:
        raise ForgetRefusedError(
            "verified_authority: no credential verifier is configured, so no authority to forget "
            "can be verified")
    if session_token is None:
        raise ForgetRefusedError(
            "verified_authority: forget needs a session credential (session_token)")
    try:
        authority = derive_effective_authority(verifier, session_token, delegation_tokens)
    except CredentialError as exc:
        raise ForgetRefusedError(f"verified_authority: {exc}") from None
    if authority.tenant != tenant:
        raise ForgetRefusedError("tenancy: the credential is for another tenant")
    if FORGET_SCOPE not in authority.scopes:
        raise ForgetRefusedError(
            f"forget_scope: the effective authority lacks the {FORGET_SCOPE!r} scope")
    return authority
