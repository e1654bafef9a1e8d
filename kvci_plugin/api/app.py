"""The REST twin of `graph_kv_checkpoint`: `POST /api/graph/kv_checkpoint` (FastAPI).

Two plain ASGI layers wrap the app, outermost first: the bearer check (when a token is
configured it guards every path, the OpenAPI schema included, and is compared in constant
time) and the body cap (a body over the limit is answered 413 before any parsing). Every
error is an `ErrorResponse` with a stable code; validation errors never echo the input back,
so a credential in a bad request is not reflected.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvci_plugin
from kvci_plugin.api.control import ControlPlane, ControlResponse
from kvci_plugin.api.errors import ControlError, ErrorCode, ErrorResponse, FieldError
from kvci_plugin.api.schema import ENDPOINT, KVCheckpointRequest, KVCheckpointResponse
from kvci_plugin.tiering.health import DEPENDENCY_ERRORS, TierUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "the body is not JSON text"),
        (401, "missing or wrong bearer credential (when the server requires one)"),
        (403, "a session credential did not verify, disagrees with the declared tenant, or "
              "lacks the authority the action needs (forget: the kv:forget scope)"),
        (404, "the checkpoint is not held for this caller, or the session has no finished request"),
        (410, "the checkpoint was fenced by a cache reset (its KV predates the reset) or forgotten "
              "(its tenant's keys were destroyed): it is never loaded"),
        (413, "the request body is over the size limit"),
        (422, "the request does not match the schema, or its observation does not compose"),
        (500, "an internal error, or a cache reset the engine failed to apply"),
    )
}

_DESCRIPTION = """The kvci control surface, served by the scheduler side of the vLLM engine.

One endpoint, eight actions (`action`): `recommend` scores a moment at the engine's RAM
admission bar and returns the advisory; `checkpoint_now` arms a session so its next finished
request keeps its KV; `promote` asks the eligibility gate for a disk copy with authority derived
from the caller's session credential; `explain` says why a checkpoint exists and why it is where
it is; `ram_stats` reports RAM-tier occupancy, the RAM admission bar, the gate in force and the
registered scorers; `advisory` returns the kvci reply of a session's latest finished request
(for responses that carried no kv_transfer_params: streams on vLLM 0.32, aborts, stop strings); `reset` (an operator action: no tenant
credential, the surface itself is loopback-only or bearer-protected) fences every checkpoint kvci
holds, in RAM and on disk, so no KV from before it is loaded after it (kvci's tiers only, not
vLLM's own prefix cache); `forget` crypto-erases one tenant (its key material and checkpoints,
for every node sharing the disk tier), gated on a verified credential with the kv:forget
scope."""


def build_app(plane: ControlPlane, *, bearer_token: bytes | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
    """The ASGI app of the control surface; `bearer_token=None` serves without authentication
    (the server only allows that on a loopback address)."""
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be at least 1024, got {max_body_bytes}")
    if bearer_token is not None and not bearer_token:
        raise ValueError("bearer_token must not be empty")
    app = FastAPI(title="kvci control surface", version=kvci_plugin.__version__,
                  description=_DESCRIPTION, docs_url=None, redoc_url=None)

    @app.post(ENDPOINT, response_model=KVCheckpointResponse, responses=_ERRORS,
              summary="graph_kv_checkpoint", operation_id="graph_kv_checkpoint")
    def graph_kv_checkpoint(request: KVCheckpointRequest) -> ControlResponse:
        # A sync handler runs on the thread pool: a wait on the manager's lock (held briefly by
        # the scheduler thread) never stalls the event loop.
        return plane.handle(request)

    app.add_exception_handler(ControlError, _control_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    limited: ASGIApp = _BodyLimit(app, max_body_bytes)
    return _BearerAuth(limited, bearer_token) if bearer_token is not None else limited


# ---- error handlers -------------------------------------------------------------------------------

def _respond(error: ControlError, *, status: int | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body().model_dump(mode="json"), status_code=status or error.status,
                        headers=headers)


async def _control_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlError)
    return _respond(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    fields = [FieldError(loc=[p for p in e.get("loc", ()) if isinstance(p, (str, int))],
                         msg=str(e.get("msg", "")))
              for e in exc.errors()]
    summary = "; ".join(f"{'.'.join(str(p) for p in f.loc)}: {f.msg}" for f in fields[:5])
    return _respond(ControlError(ErrorCode.INVALID_REQUEST, summary or "invalid request", fields))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {400: ErrorCode.INVALID_BODY, 404: ErrorCode.NOT_FOUND,
            405: ErrorCode.METHOD_NOT_ALLOWED}.get(exc.status_code, ErrorCode.INVALID_REQUEST)
    return _respond(ControlError(code, str(exc.detail)), status=exc.status_code, headers=exc.headers)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, (TierUnavailableError, *DEPENDENCY_ERRORS)):
        # Not kvci's bug: the disk tier's dependency is down or slow (its health says since when).
        return _respond(ControlError(ErrorCode.TIER_UNAVAILABLE,
                                     f"the disk tier is unavailable ({type(exc).__name__}); "
                                     "try again once ram_stats shows it healthy"))
    logger.exception("kvci control surface: unhandled error")
    return _respond(ControlError(ErrorCode.INTERNAL_ERROR, f"internal error ({type(exc).__name__})"))


# ---- ASGI layers ----------------------------------------------------------------------------------

async def _send_error(send: Send, error: ControlError, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error.body().model_dump(mode="json")).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class _BearerAuth:
    def __init__(self, app: ASGIApp, token: bytes) -> None:
        self._app = app
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        header = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, presented = header.partition(b" ")
        # compare_digest takes time independent of where the bytes differ.
        if scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), self._token):
            await self._app(scope, receive, send)
            return
        await _send_error(send, ControlError(ErrorCode.UNAUTHORIZED, "a valid bearer credential is required"),
                          headers={"WWW-Authenticate": 'Bearer realm="kvci"'})


class _BodyLimit:
    """Reads the whole body, up to the limit, before the app sees any of it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        too_large = ControlError(ErrorCode.BODY_TOO_LARGE, f"request body is over {self._limit} bytes")
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, ControlError(ErrorCode.INVALID_BODY, "bad Content-Length header"))
                return
            if int(declared) > self._limit:
                await _send_error(send, too_large)
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
                await _send_error(send, too_large)
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
