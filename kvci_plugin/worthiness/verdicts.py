"""The verdict each session's latest finished request published, for clients that never saw it.

vLLM 0.32 returns `kv_transfer_params` only on non-streaming responses (0.33 also on a stream's
final chunk; an abort or a stop string loses them on both), so such an agent gets no advisory
back. The scheduler keeps, per (tenant, session_id), the `kvci` object it would have
returned, and the control surface's `advisory` action hands it over. A verdict is per-run
state, read only within its run's tenant: one tenant's session never reads another's, and a verdict
published under a verified session credential is read only with a verified one (a declared tenant
proves nothing). Bounded per tenant and in all: the least recently published sessions go first, and
one tenant's many sessions cannot push out every other tenant's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_SESSIONS = 4096
MAX_SESSIONS_PER_TENANT = 512


@dataclass(frozen=True)
class PublishedVerdict:
    kvci: dict[
        str, Any
    ]  # the response's kv_transfer_params.kvci, as a non-streaming client gets it
    finished_at: float  # wall-clock time the request finished
    verified: bool  # the request's tenant came from a verified session credential


class PublishedVerdicts:
    """Written by the scheduler thread, read by the control surface's threads."""

    def __init__(self, max_sessions: int = MAX_SESSIONS,
                 max_per_tenant: int = MAX_SESSIONS_PER_TENANT) -> None:
        if not 1 <= max_per_tenant <= max_sessions:
            raise ValueError(
                f"need 1 <= max_per_tenant ({max_per_tenant}) <= max_sessions ({max_sessions})"
            )
        self._max, self._max_per_tenant = max_sessions, max_per_tenant
        self._lock = threading.Lock()
        # Stored as JSON text: a reader gets its own copy, and nobody's edit reaches the store.
        self._latest: OrderedDict[tuple[str, str], tuple[str, float, bool]] = OrderedDict()
        self._per_tenant: dict[str, OrderedDict[str, None]] = {}

    def publish(
        self, tenant: str, session_id: str, kvci: dict[str, Any], *, verified: bool
    ) -> None:
        entry = (json.dumps(kvci), time.time(), verified)
        with self._lock:
            key = (tenant, session_id)
            self._latest[key] = entry
            self._latest.move_to_end(key)
            sessions = self._per_tenant.setdefault(tenant, OrderedDict())
            sessions[session_id] = None
            sessions.move_to_end(session_id)
            if len(sessions) > self._max_per_tenant:
                self._forget((tenant, next(iter(sessions))))
            while len(self._latest) > self._max:
                self._forget(next(iter(self._latest)))

    def latest(self, tenant: str, session_id: str, *, verified: bool) -> PublishedVerdict | None:
        """None also when the verdict was published under a verified credential and the caller
        has none: the same answer as for a session that never finished a request."""
        with self._lock:
            entry = self._latest.get((tenant, session_id))
        if entry is None or (entry[2] and not verified):
            return None
        text, finished_at, was_verified = entry
        return PublishedVerdict(
            kvci=json.loads(text), finished_at=finished_at, verified=was_verified
        )

    def _forget(self, key: tuple[str, str]) -> None:
        del self._latest[key]
        sessions = self._per_tenant[key[0]]
        del sessions[key[1]]
        if not sessions:
            del self._per_tenant[key[0]]
