"""The `kvci` object of a request's `kv_transfer_params`.

A client that sends nothing gets nothing back: the advisory channel stays silent and the request
behaves exactly as without kvci. Bad input fails only this request's kvci handling; the request
itself still completes and its response params carry the error.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvci_plugin.governance.names import TenantName

PARAMS_KEY = "kvci"
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:@/-]+$"
SESSION_ID_MAX_CHARS = 128


class RetainParams(BaseModel):
    """Keep this request's KV in RAM, exempt from eviction, until ``ttl_s`` passes or the
    session's next request arrives (bounded by the engine's max_retain_s)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    ttl_s: float = Field(gt=0.0, description="seconds the KV is exempt from eviction")


class KVCIRequestParams(BaseModel):
    """What a client may say about its request (all optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    tenant: TenantName | None = Field(
        None, description="declared tenant (ignored in favour of a verified session's; must agree)")
    session_token: str | None = Field(
        None, min_length=1, max_length=8192, description="signed session credential (JWT)")
    delegation_tokens: list[Annotated[str, Field(min_length=1, max_length=8192)]] = Field(
        default_factory=list, max_length=8, description="delegation credentials, root to leaf")
    source_ids: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=256, description="sources the context was built from")
    session_id: str | None = Field(
        None, min_length=1, max_length=SESSION_ID_MAX_CHARS, pattern=SESSION_ID_PATTERN,
        description="groups turns: context churn, armed checkpoints, automatic retention "
        "(none: vLLM's own Request.session_id, where it has one)")
    observation: dict[str, Any] | None = Field(
        None, description="CheckpointObservation fields the client measured")
    evidence_bundle: dict[str, Any] | None = Field(None, description="a retrieval result")
    context_bundle: dict[str, Any] | None = Field(None, description="a context-compile result")
    trigger: Literal["user", "agent"] | None = Field(
        None, description="who asks for checkpoint/persist (provenance only, grants nothing)")
    checkpoint: Literal["now", "never"] | None = Field(
        None, description="`now`: keep this request's KV in RAM; `never`: keep nothing of it (the "
        "system trigger and a checkpoint armed for its session pass it by; it may still hit)")
    persist: bool = Field(False, description="also ask the gate for a durable disk copy")
    retain: RetainParams | None = Field(
        None, description='`{"ttl_s": s}`: keep this request\'s KV in RAM, exempt from eviction, '
        "for s seconds (at most max_retain_s) or until its session's next request, whichever "
        "first; within the tenant quota; RAM only: grants nothing on disk")

    @model_validator(mode="after")
    def _one_wish(self) -> KVCIRequestParams:
        if self.opted_out and (self.persist or self.retain is not None):
            wish = "persist" if self.persist else "retain"
            raise ValueError(f"{wish} asks to keep this request's KV and checkpoint 'never' not to")
        return self

    @property
    def opted_out(self) -> bool:
        """The client asked that nothing of this request be kept."""
        return self.checkpoint == "never"

    @property
    def explicit_trigger(self) -> str | None:
        """The trigger this request asks for, if it asks to keep its KV at all (a retention is
        the agent's keep decision)."""
        if self.checkpoint == "now" or self.persist:
            return self.trigger or "user"
        if self.retain is not None:
            return self.trigger or "agent"
        return None


class ParamsError(ValueError):
    """The request's kvci params were rejected; the message is safe to return to the client."""


def parse_request_params(kv_transfer_params: Any, max_bytes: int) -> KVCIRequestParams | None:
    """None when the request carries no `kvci` object; ParamsError when it is malformed."""
    if not isinstance(kv_transfer_params, dict) or PARAMS_KEY not in kv_transfer_params:
        return None
    raw = kv_transfer_params[PARAMS_KEY]
    if not isinstance(raw, dict):
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} must be an object")
    try:
        size = len(json.dumps(raw, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} is not JSON: {exc}") from None
    if size > max_bytes:
        raise ParamsError(f"kv_transfer_params.{PARAMS_KEY} is {size} bytes, over {max_bytes}")
    try:
        return KVCIRequestParams.model_validate(raw)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
        )
        raise ParamsError(f"invalid kv_transfer_params.{PARAMS_KEY}: {errors}") from None
