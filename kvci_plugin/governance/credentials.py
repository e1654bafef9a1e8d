"""What a verified credential says: a session's authority, or a delegation's ceiling."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from kvci_plugin.governance.classification import Classification
from kvci_plugin.governance.names import NameSet, TenantName

PolicyVersion = StrictInt | StrictStr
MAX_DELEGATION_HOPS = 8
DelegationJti = Annotated[StrictStr, Field(min_length=1)]


class VerifiedSession(BaseModel):
    """A session credential whose signature, audience, validity window and revocation were
    checked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    actor: str = Field(min_length=1)
    tenant: TenantName  # the one rule for tenant names: a credential can name no other
    scopes: NameSet
    clearance: Classification
    markings: NameSet
    regions: NameSet
    policy_version: PolicyVersion
    jti: str = Field(min_length=1)
    not_before: float
    expires_at: float
    # A delegate's session names the delegations that cap it (their jti, root first): it is
    # refused without exactly that chain, so a ceiling cannot be left out. Empty: the session
    # is its principal's own (a ceiling presented with it still caps it).
    delegations: tuple[DelegationJti, ...] = Field(default=(), max_length=MAX_DELEGATION_HOPS)


class DelegationCeiling(BaseModel):
    """A verified delegation: `delegator` lets `delegate` act within this ceiling, in `tenant`.

    The ceiling caps authority; it never adds any. Each field is required: a ceiling with an
    undeclared axis is unresolvable and denies.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    jti: str = Field(min_length=1)
    tenant: TenantName
    delegator: str = Field(min_length=1)
    delegate: str = Field(min_length=1)
    scopes: NameSet
    clearance: Classification
    markings: NameSet
    regions: NameSet
    not_before: float
    expires_at: float
