"""Who a request's KV belongs to, and who may forget a tenant.

The tenant comes from the verified session credential when the request carries one (a declared
tenant that disagrees is an error). Otherwise, with ``tenancy: "declared"`` (the default), from
the declared `tenant` — which is only as trustworthy as the gateway in front of vLLM, exactly
like vLLM's own `cache_salt`; no tenant at all shares the `default` tenant. With
``tenancy: "verified"`` a declared tenant sets nothing: a request without a verified session
credential is refused a tenant, so it is served with no kvci tier (no lookup, no store) and its
reply says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvci_plugin.governance import CredentialError, CredentialVerifier, authorize_forget
from kvci_plugin.request.params import KVCIRequestParams, ParamsError

DEFAULT_TENANT = "default"
Tenancy = Literal["declared", "verified"]

UNVERIFIED = ("tenancy is \"verified\": only a verified session credential (session_token) sets "
              "the tenant, and this request carries none; it is served without any kvci tier "
              "(no lookup, no store)")


class TenantResolver:
    def __init__(self, verifier: CredentialVerifier | None, tenancy: Tenancy = "declared") -> None:
        if tenancy == "verified" and verifier is None:
            raise ValueError("tenancy 'verified' needs a credential verifier")
        self._verifier = verifier
        self.tenancy = tenancy
        self.default = DEFAULT_TENANT

    def resolve(self, params: KVCIRequestParams | None) -> str:
        if params is None or params.session_token is None:
            if self.tenancy == "verified":
                raise ParamsError(UNVERIFIED)
            return self.default if params is None else params.tenant or self.default
        if self._verifier is None:
            raise ParamsError(
                "session_token given but this server verifies no credentials "
                "(kv_connector_extra_config.credentials is not set)")
        try:
            session = self._verifier.verify_session(params.session_token)
        except CredentialError as exc:
            raise ParamsError(f"session_token refused: {exc}") from None
        if params.tenant is not None and params.tenant != session.tenant:
            raise ParamsError("declared tenant disagrees with the session credential's tenant")
        return session.tenant

    def authorize_forget(self, tenant: str, session_token: str | None,
                         delegation_tokens: Sequence[str] = ()) -> None:
        """``ForgetRefusedError`` unless a verified credential of ``tenant`` holds the forget
        scope (see ``kvci_plugin.governance.erasure``)."""
        authorize_forget(self._verifier, tenant, session_token, delegation_tokens)
