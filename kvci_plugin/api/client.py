"""A client of the control endpoint, shared by the `kvci` command line and the MCP server.

Every call carries the bearer token read from `token_file` (the operator's or the tenants'); an
`https://` endpoint's certificate is verified against `ca_file` (else the system's roots)."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from kvci_plugin.api.errors import ErrorCode
from kvci_plugin.api.schema import ENDPOINT, RESET_WAIT_S_MAX
from kvci_plugin.api.tokens import load_bearer_token

DEFAULT_CONTROL_PORT = 8477
DEFAULT_CONTROL_URL = f"http://127.0.0.1:{DEFAULT_CONTROL_PORT}"
# The client's own code, beside the server's ErrorCode values: the endpoint did not answer.
UNREACHABLE = "unreachable"


class ControlCallError(Exception):
    """The control endpoint refused a call (`code` is its ErrorCode), or did not answer
    (`status` None, `code` UNREACHABLE)."""

    def __init__(
        self, status: int | None, code: str, message: str, body: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = dict(body) if body is not None else None


class ControlClient:
    """POSTs `graph_kv_checkpoint` requests to `url` (the control server's base URL)."""

    def __init__(self, url: str = DEFAULT_CONTROL_URL, *, token_file: Path | None = None,
                 ca_file: Path | None = None, timeout_s: float = 30.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"control url must start with http:// or https://, got {url!r}")
        headers = (
            {"Authorization": f"Bearer {load_bearer_token(token_file).decode()}"}
            if token_file
            else {}
        )
        verify: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=str(ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"CA file {ca_file}: {exc}") from None
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, verify=verify
        )

    def call(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The action's response body; ControlCallError for an error response or no answer."""
        # A reset waits up to its wait_s for the engine before answering: the read may take that
        # long.
        wait_s = request.get("wait_s")
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if (isinstance(wait_s, (int, float)) and not isinstance(wait_s, bool)
                and 0 < wait_s <= RESET_WAIT_S_MAX):
            timeout = self._timeout_s + float(wait_s)
        try:
            response = self._http.post(ENDPOINT, json=dict(request), timeout=timeout)
        except httpx.HTTPError as exc:
            raise ControlCallError(
                None, UNREACHABLE, f"no answer from {self.url}: {type(exc).__name__}: {exc}"
            ) from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.is_success and isinstance(body, dict):
            return body
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            raise ControlCallError(
                response.status_code, str(error.get("code")), str(error.get("message")), body
            )
        raise ControlCallError(response.status_code, ErrorCode.INTERNAL_ERROR.value,
                               f"unexpected {response.status_code} answer from {self.url}")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
