"""The control surface's errors: a stable code, an HTTP status and a message safe to show.

Codes are part of the API (clients branch on them); messages are for people and may change.
A message never carries a credential, a key or token text.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict


class ErrorCode(str, Enum):
    INVALID_BODY = "invalid_body"  # 400: the body cannot be read as JSON text
    INVALID_REQUEST = "invalid_request"  # 422: the body does not match the schema
    INVALID_OBSERVATION = "invalid_observation"  # 422: observation + bundles do not compose
    BODY_TOO_LARGE = "body_too_large"  # 413
    UNAUTHORIZED = "unauthorized"  # 401: missing or wrong bearer credential
    CREDENTIAL_REFUSED = "credential_refused"  # 403: a session credential did not verify
    OPERATOR_REQUIRED = "operator_required"  # 403: an operator action asked with the tenant token
    HOST_NOT_ALLOWED = "host_not_allowed"  # 403: the Host header is not on the allow-list
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"  # 403: a browser Origin not on the allow-list
    CHECKPOINT_NOT_FOUND = "checkpoint_not_found"  # 404: not held (or held for another tenant)
    NO_ADVISORY = "no_advisory"  # 404: no finished request of that session (for this tenant)
    CHECKPOINT_FENCED = "checkpoint_fenced"  # 410: a cache reset dropped it (its KV predates it)
    CHECKPOINT_FORGOTTEN = "checkpoint_forgotten"  # 410: its tenant was forgotten (crypto-erased)
    NOT_FOUND = "not_found"  # 404: no such path
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    INTERNAL_ERROR = "internal_error"  # 500
    TIER_UNAVAILABLE = "tier_unavailable"  # 503: the disk tier's catalog or blob store is down


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_BODY: 400,
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.INVALID_OBSERVATION: 422,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.CREDENTIAL_REFUSED: 403,
    ErrorCode.OPERATOR_REQUIRED: 403,
    ErrorCode.HOST_NOT_ALLOWED: 403,
    ErrorCode.ORIGIN_NOT_ALLOWED: 403,
    ErrorCode.CHECKPOINT_NOT_FOUND: 404,
    ErrorCode.NO_ADVISORY: 404,
    ErrorCode.CHECKPOINT_FENCED: 410,
    ErrorCode.CHECKPOINT_FORGOTTEN: 410,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.TIER_UNAVAILABLE: 503,
}


class FieldError(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    loc: list[str | int]
    msg: str


class ErrorBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    code: ErrorCode
    message: str
    fields: list[FieldError] = []


class ErrorResponse(BaseModel):
    """Every non-2xx answer of the control surface."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: ErrorBody


class ControlError(Exception):
    """An action refused with a stable code (the REST layer turns it into an ErrorResponse)."""

    def __init__(
        self, code: ErrorCode, message: str, fields: list[FieldError] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields or []

    @property
    def status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(code=self.code, message=self.message, fields=self.fields)
        )
