"""The plain ASGI layers in front of the control surface's app, outermost first:

1. `HostGuard`: the `Host` header must be on the allow-list and an `Origin` header, when present,
   too (403 host_not_allowed / origin_not_allowed), before anything else is looked at.
2. `BearerAuth`: `Authorization: Bearer <token>` must be the operator's or the tenants' token
   (compared in constant time; 401 otherwise) on every path, the OpenAPI schema included; the
   role it proves is put in the request's scope (`ROLE_KEY`) for the actions to check.
3. `BodyLimit`: a body over the limit is answered 413 before any parsing.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvci_plugin.api.access import HostPolicy
from kvci_plugin.api.errors import ControlError, ErrorCode
from kvci_plugin.api.roles import Role

ROLE_KEY = "kvci.role"


@dataclass(frozen=True)
class BearerTokens:
    """The two tokens the surface accepts: each proves one role."""

    operator: bytes
    tenant: bytes

    def __post_init__(self) -> None:
        if not self.operator or not self.tenant:
            raise ValueError("bearer tokens must not be empty")
        if hmac.compare_digest(self.operator, self.tenant):
            raise ValueError("the operator and tenant tokens must differ")

    def role_of(self, presented: bytes) -> Role | None:
        # Both compared, each in constant time: the answer's timing says nothing of either token.
        operator = hmac.compare_digest(presented, self.operator)
        tenant = hmac.compare_digest(presented, self.tenant)
        return Role.OPERATOR if operator else Role.TENANT if tenant else None


async def send_error(
    send: Send, error: ControlError, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error.body().model_dump(mode="json")).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    values = [v for k, v in scope.get("headers", ()) if k == name]
    if len(values) > 1:
        return b""  # two of one header: matches nothing
    return values[0] if values else None


class HostGuard:
    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self._app = app
        self._policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        # The names are not echoed: the answer carries nothing a page could read back.
        if not self._policy.allows_host(_header(scope, b"host")):
            await send_error(send, ControlError(
                ErrorCode.HOST_NOT_ALLOWED, "the Host header names no address this control surface "
                "answers (control_allowed_hosts lists more)"))
            return
        if not self._policy.allows_origin(_header(scope, b"origin")):
            await send_error(
                send,
                ControlError(
                    ErrorCode.ORIGIN_NOT_ALLOWED,
                    "requests from browser pages of this Origin are refused "
                    "(control_allowed_origins lists the allowed ones)",
                ),
            )
            return
        await self._app(scope, receive, send)


class BearerAuth:
    def __init__(self, app: ASGIApp, tokens: BearerTokens) -> None:
        self._app = app
        self._tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        scheme, _, presented = (_header(scope, b"authorization") or b"").partition(b" ")
        role = self._tokens.role_of(presented.strip()) if scheme.lower() == b"bearer" else None
        if role is None:
            await send_error(
                send,
                ControlError(ErrorCode.UNAUTHORIZED, "a valid bearer credential is required"),
                headers={"WWW-Authenticate": 'Bearer realm="kvci"'},
            )
            return
        await self._app({**scope, ROLE_KEY: role}, receive, send)


class BodyLimit:
    """Reads the whole body, up to the limit, before the app sees any of it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        too_large = ControlError(
            ErrorCode.BODY_TOO_LARGE, f"request body is over {self._limit} bytes"
        )
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await send_error(
                    send, ControlError(ErrorCode.INVALID_BODY, "bad Content-Length header")
                )
                return
            if int(declared) > self._limit:
                await send_error(send, too_large)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._limit:
                await send_error(send, too_large)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self._app(scope, replay, send)
