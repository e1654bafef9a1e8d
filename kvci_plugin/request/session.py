"""A request's session (the turns of one conversation or agent run) and by whose word it is known.

The client's ``kvci.session_id`` names it. Where the client named none, vLLM's own
``Request.session_id`` (0.34 on) stands in: vLLM's OpenAI server fills it from the body's
``session_id``, the ``X-Session-ID`` header or ``vllm_xargs.session_id``, so an agent framework
that already sends one of those gets automatic retention, return-gap learning and churn per
session without a kvci field. Either way the session is scoped to the request's tenant, so an id
never reaches another tenant's retentions or verdicts.

vLLM's id is free text; one that kvci's own pattern does not admit is kept as a digest of it
rather than refused: an id never fails a request, and the same id always maps to the same
session.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal

from kvci_plugin.request.params import SESSION_ID_MAX_CHARS, SESSION_ID_PATTERN, KVCIRequestParams

_ADMITTED = re.compile(SESSION_ID_PATTERN)
DIGEST_PREFIX = "sha256:"


@dataclass(frozen=True)
class RequestSession:
    session_id: str
    by: Literal["client", "vllm"]  # kvci.session_id, or vLLM's Request.session_id


def request_session(params: KVCIRequestParams | None, request: Any) -> RequestSession | None:
    """The request's session: the client's ``kvci.session_id``, else vLLM's; None when neither
    names one (or this vLLM has no ``Request.session_id``)."""
    if params is not None and params.session_id is not None:
        return RequestSession(params.session_id, "client")
    engine = getattr(request, "session_id", None)
    if not isinstance(engine, str) or not engine:
        return None
    return RequestSession(admitted_session_id(engine), "vllm")


def admitted_session_id(value: str) -> str:
    """``value`` as kvci holds a session id: itself when kvci's pattern admits it, else a digest."""
    if len(value) <= SESSION_ID_MAX_CHARS and _ADMITTED.fullmatch(value):
        return value
    return DIGEST_PREFIX + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
