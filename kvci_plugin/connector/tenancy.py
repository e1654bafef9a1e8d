"""Who a request's KV belongs to.

The tenant comes from the verified session credential when the request carries one (a declared
tenant that disagrees is an error). Otherwise from the declared `tenant` — which is only as
trustworthy as the gateway in front of vLLM, exactly like vLLM's own `cache_salt`. No tenant at
all shares the `default` tenant.
"""

from __future__ import annotations

from kvci_plugin.connector.params import KVCIRequestParams, ParamsError
from kvci_plugin.governance import CredentialError, CredentialVerifier

DEFAULT_TENANT = "default"


class TenantResolver:
    def __init__(self, verifier: CredentialVerifier | None) -> None:
        self._verifier = verifier
        self.default = DEFAULT_TENANT

    def resolve(self, params: KVCIRequestParams | None) -> str:
        if params is None:
            return self.default
        if params.session_token is not None:
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
        return params.tenant or self.default
