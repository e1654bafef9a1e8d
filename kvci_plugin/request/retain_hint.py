"""A retention order carried in vLLM's KV hints: the ``kvci.retain`` action of ``Request.kv_hints``.

vLLM's ``KvHintsEnvelope`` (``kvci_plugin.request.hints``) is transport only: each action's
``payload`` schema is the action's, validated by whoever implements it, and neither vLLM 0.34 nor
KVCR defines a retention action. kvci defines one, versioned:

    {"action_id": "...", "action_type": "kvci.retain", "action_version": "1",
     "payload": {"ttl_s": 120.0, "priority": 10}}

``ttl_s`` (seconds, > 0, finite; required) is how long the request's checkpoint is exempt from
eviction; ``priority`` (an integer 0..100, default 0) picks the order an envelope's several
``kvci.retain`` actions yield: the highest is taken (the first of equals). A retention is exempt
from eviction whatever its priority, so priority orders nothing else; the reply and ``explain``
show it. The order is carried out exactly as a client's ``kvci.retain`` is, within the same
bounds (the connector trims ``ttl_s`` to ``max_retain_s`` and the RAM tier refuses it past the
tenant's share). A malformed action, an unknown version or an unknown payload field is not an
order: it is named in ``problems`` (for a debug log line) and never fails the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvci_plugin.request.hints import KVHints

RETAIN_ACTION = "kvci.retain"
RETAIN_VERSIONS = ("1",)
MAX_PRIORITY = 100


class RetainHintPayload(BaseModel):
    """The payload of a ``kvci.retain`` action, version 1."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    ttl_s: float = Field(gt=0.0, description="seconds the checkpoint is exempt from eviction")
    priority: int = Field(0, ge=0, le=MAX_PRIORITY,
                          description="which of an envelope's retention orders is taken")


@dataclass(frozen=True)
class RetainHint:
    """The retention order an envelope carries."""

    ttl_s: float
    priority: int
    action_id: str


def retain_hint(hints: KVHints | None) -> tuple[RetainHint | None, tuple[str, ...]]:
    """The envelope's retention order (None: none it could take) and what was ignored, and why.
    Never raises."""
    if hints is None:
        return None, ()
    best: RetainHint | None = None
    problems: list[str] = []
    for action in hints.of_type(RETAIN_ACTION):
        where = f"kv_hints action {action.action_id!r} ({RETAIN_ACTION})"
        if action.action_version not in RETAIN_VERSIONS:
            problems.append(f"{where}: version {action.action_version!r} unknown "
                            f"(known: {', '.join(RETAIN_VERSIONS)}): ignored")
            continue
        try:
            payload = RetainHintPayload.model_validate(dict(action.payload))
        except (ValidationError, TypeError, ValueError) as exc:
            problems.append(f"{where}: bad payload ({_errors(exc)}): ignored")
            continue
        if best is None or payload.priority > best.priority:
            best = RetainHint(payload.ttl_s, payload.priority, action.action_id)
    return best, tuple(problems)


def _errors(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
                         for e in exc.errors())
    return f"{type(exc).__name__}: {exc}"
