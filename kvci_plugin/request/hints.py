"""The KV hints an orchestrator attaches to a request: vLLM's ``Request.kv_hints``.

vLLM (0.32 on) carries a ``KvHintsEnvelope`` from ``AsyncLLM.generate(kv_hints=...)`` to the
connector on ``Request.kv_hints``: a ``protocol_version``, a ``message_id`` and a list of
actions, each an ``action_id``, ``action_type``, ``action_version`` and a JSON ``payload`` whose
schema is the action's. It is the emerging way orchestrators pass retention hints. kvci reads it
here, as plain data, and acts on its own retention action only (``kvci.retain``, version "1":
``kvci_plugin.request.retain_hint``): reading never fails a request — an envelope
absent, ``None``, of another shape or of an unknown version reads as what could be read, and
what could not is named in ``problems``. Read duck-typed (no vLLM import): msgspec structs and
plain dicts alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_ACTIONS = 64
"""Actions read from one envelope; the rest are dropped (named in ``problems``)."""


@dataclass(frozen=True)
class KVHintAction:
    action_id: str
    action_type: str
    action_version: str
    payload: Mapping[str, Any]


@dataclass(frozen=True)
class KVHints:
    protocol_version: str
    message_id: str
    actions: tuple[KVHintAction, ...] = ()
    problems: tuple[str, ...] = field(default=())  # what could not be read, for a log line

    def of_type(self, action_type: str) -> tuple[KVHintAction, ...]:
        return tuple(a for a in self.actions if a.action_type == action_type)


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def read_kv_hints(request: Any) -> KVHints | None:
    """The request's KV hints; None when it carries none (or a vLLM without them). Never raises."""
    envelope = getattr(request, "kv_hints", None)
    if envelope is None:
        return None
    try:
        return _read(envelope)
    except Exception as exc:  # a shape nobody foresaw: unreadable, never a failed request
        return KVHints("", "", (), (f"unreadable kv_hints ({type(exc).__name__}: {exc})",))


def _read(envelope: Any) -> KVHints:
    problems: list[str] = []
    version, message = (
        _text(_get(envelope, "protocol_version")),
        _text(_get(envelope, "message_id")),
    )
    if version is None:
        problems.append("kv_hints.protocol_version is not a string")
    if message is None:
        problems.append("kv_hints.message_id is not a string")
    raw = _get(envelope, "actions")
    if raw is None:
        raw = []
    elif isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):
        problems.append("kv_hints.actions is not a list")
        raw = []
    actions: list[KVHintAction] = []
    for i, item in enumerate(raw):
        if i >= MAX_ACTIONS:
            problems.append(f"kv_hints: actions past the first {MAX_ACTIONS} dropped")
            break
        fields = [_text(_get(item, f)) for f in ("action_id", "action_type", "action_version")]
        payload = _get(item, "payload")
        if any(f is None for f in fields) or not isinstance(payload, Mapping):
            problems.append(f"kv_hints.actions[{i}] is not a KvHintAction: dropped")
            continue
        actions.append(KVHintAction(*fields, payload))  # type: ignore[arg-type]
    return KVHints(version or "", message or "", tuple(actions), tuple(problems))
