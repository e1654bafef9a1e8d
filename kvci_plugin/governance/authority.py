"""Effective authority: the verified session intersected with every delegation ceiling."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from kvci_plugin.governance.classification import Classification
from kvci_plugin.governance.credential_error import CredentialError, CredentialErrorReason
from kvci_plugin.governance.credentials import DelegationCeiling, PolicyVersion
from kvci_plugin.governance.names import NameSet
from kvci_plugin.governance.verifier import CredentialVerifier


class EffectiveAuthority(BaseModel):
    """What the session's actor may do here and now. Never more than the session or any ceiling."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    actor: str
    tenant: str
    scopes: NameSet
    clearance: Classification
    markings: NameSet
    regions: NameSet
    policy_version: PolicyVersion
    session_jti: str
    session_expires_at: float
    # Root first: delegation_chain[0].delegator is the ultimate principal and the last hop's
    # delegate is the session's actor.
    delegation_chain: tuple[DelegationCeiling, ...] = Field(default=())


def derive_effective_authority(
    verifier: CredentialVerifier, session_token: str, delegation_tokens: Sequence[str] = ()
) -> EffectiveAuthority:
    """Verify every credential now and intersect: scopes, markings and regions by set
    intersection, clearance by minimum. `delegation_tokens` run root to leaf and must link
    (each hop's delegate is the next hop's delegator, the last delegate is the session actor)
    within the session's tenant; a chain that does not is unresolvable and raises. A session
    that names its ceilings (the `delegations` claim of a delegate's session) is unresolvable
    without exactly the chain it names: a ceiling is never voluntary for a delegate.

    The intersection is unconditional: no setting turns it into a warning.
    """
    try:
        session = verifier.verify_session(session_token)
    except CredentialError as exc:
        raise exc.for_credential("session") from exc

    chain: list[DelegationCeiling] = []
    for index, token in enumerate(delegation_tokens):
        name = f"delegation[{index}]"
        try:
            hop = verifier.verify_delegation(token)
        except CredentialError as exc:
            raise exc.for_credential(name) from exc
        if hop.tenant != session.tenant:
            raise _unresolvable(
                name, f"ceiling is for tenant {hop.tenant!r}, the session is in {session.tenant!r}"
            )
        if chain and chain[-1].delegate != hop.delegator:
            raise _unresolvable(
                name,
                f"delegator {hop.delegator!r} is not the previous hop's delegate "
                f"{chain[-1].delegate!r}",
            )
        chain.append(hop)
    if chain and chain[-1].delegate != session.actor:
        raise _unresolvable(
            f"delegation[{len(chain) - 1}]",
            f"the chain ends at delegate {chain[-1].delegate!r}, but the session's actor is "
            f"{session.actor!r}",
        )
    _check_named_chain(session.delegations, chain)

    scopes, clearance, markings, regions = (
        session.scopes,
        session.clearance,
        session.markings,
        session.regions,
    )
    for hop in chain:
        scopes &= hop.scopes
        clearance = min(clearance, hop.clearance)
        markings &= hop.markings
        regions &= hop.regions
    return EffectiveAuthority(
        actor=session.actor,
        tenant=session.tenant,
        scopes=scopes,
        clearance=clearance,
        markings=markings,
        regions=regions,
        policy_version=session.policy_version,
        session_jti=session.jti,
        session_expires_at=session.expires_at,
        delegation_chain=tuple(chain),
    )


def _check_named_chain(named: tuple[str, ...], chain: list[DelegationCeiling]) -> None:
    """A delegate's session names its ceilings (jti, root first): exactly that chain must come
    with it, so leaving a ceiling out never leaves the full session authority."""
    if not named:
        return
    presented = [hop.jti for hop in chain]
    if presented == list(named):
        return
    index = next((i for i, (a, b) in enumerate(zip(presented, named)) if a != b),
                 min(len(presented), len(named)))
    expected = ", ".join(repr(jti) for jti in named)
    got = ", ".join(repr(jti) for jti in presented) or "none"
    raise _unresolvable(
        f"delegation[{index}]",
        f"the session names its delegation ceiling(s) {expected} (root first) and is refused "
        f"without exactly that chain; presented: {got}")


def _unresolvable(credential: str, detail: str) -> CredentialError:
    return CredentialError(CredentialErrorReason.UNRESOLVABLE_DELEGATION, detail, credential)
