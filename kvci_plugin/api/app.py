"""The REST twin of `graph_kv_checkpoint`: `POST /api/graph/kv_checkpoint` (FastAPI).

Three plain ASGI layers wrap the app (`guards`), outermost first: the Host and Origin
allow-lists, the bearer check (the operator's or the tenants' token, on every path, the OpenAPI
schema included; the role it proves goes to the action) and the body cap. There is no
unauthenticated mode. Every error is an `ErrorResponse` with a stable code; validation errors
never echo the input back, so a credential in a bad request is not reflected.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

import kvci_plugin
from kvci_plugin.api.access import HostPolicy
from kvci_plugin.api.control import ControlPlane, ControlResponse
from kvci_plugin.api.errors import ControlError, ErrorCode, ErrorResponse, FieldError
from kvci_plugin.api.guards import ROLE_KEY, BearerAuth, BearerTokens, BodyLimit, HostGuard
from kvci_plugin.api.schema import ENDPOINT, KVCheckpointRequest, KVCheckpointResponse
from kvci_plugin.tiering.health import DEPENDENCY_ERRORS, TierUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 256 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "the body is not JSON text"),
        (401, "missing or wrong bearer token (the operator's or the tenants')"),
        (403, "the Host or Origin header is not allowed; an operator action asked with the "
              "tenant token; or a session credential did not verify, disagrees with the declared "
              "tenant, or lacks the authority the action needs (forget: the kv:forget scope)"),
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
it is; `ram_stats` reports RAM-tier occupancy, the RAM admission bar, the eligibility gate in
force and the registered scorers; `advisory` returns the kvci reply of a session's latest
finished request (for responses that carried no kv_transfer_params: streams on vLLM 0.32,
aborts, stop strings); `reset` (the operator's: it needs the operator token) fences every
checkpoint kvci holds, in RAM and on disk, so no KV from before it is loaded after it (kvci's
tiers only, not vLLM's own prefix cache); `forget` crypto-erases one tenant (its key material
and checkpoints, for every node sharing the disk tier), gated on a verified credential with the
kv:forget scope.

Every call carries `Authorization: Bearer <token>`: the operator token may do everything; the
tenant token acts within one tenant (the one its verified session credential names, or with
tenancy "declared" the one it declares): `explain` and `ram_stats` then show that tenant's
checkpoints and bytes only, and `reset` answers 403 operator_required."""


def build_app(plane: ControlPlane, *, tokens: BearerTokens, hosts: HostPolicy,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
    """The ASGI app of the control surface: answers the `hosts` allow-lists only, and only calls
    bearing one of `tokens`."""
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be at least 1024, got {max_body_bytes}")
    app = FastAPI(title="kvci control surface", version=kvci_plugin.__version__,
                  description=_DESCRIPTION, docs_url=None, redoc_url=None)

    @app.post(ENDPOINT, response_model=KVCheckpointResponse, responses=_ERRORS,
              summary="graph_kv_checkpoint", operation_id="graph_kv_checkpoint")
    def graph_kv_checkpoint(request: KVCheckpointRequest, http: Request) -> ControlResponse:
        # A sync handler runs on the thread pool: a wait on the manager's lock (held briefly by
        # the scheduler thread) never stalls the event loop.
        return plane.handle(request, http.scope[ROLE_KEY])

    app.add_exception_handler(ControlError, _control_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    return HostGuard(BearerAuth(BodyLimit(app, max_body_bytes), tokens), hosts)


# ---- error handlers ------------------------------------------------------------------------------

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
    return _respond(
        ControlError(code, str(exc.detail)), status=exc.status_code, headers=exc.headers
    )


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, (TierUnavailableError, *DEPENDENCY_ERRORS)):
        # Not kvci's bug: the disk tier's dependency is down or slow (its health says since when).
        return _respond(ControlError(ErrorCode.TIER_UNAVAILABLE,
                                     f"the disk tier is unavailable ({type(exc).__name__}); "
                                     "try again once ram_stats shows it healthy"))
    logger.exception("kvci control surface: unhandled error")
    return _respond(
        ControlError(ErrorCode.INTERNAL_ERROR, f"internal error ({type(exc).__name__})")
    )
