"""The verdict each session's latest finished request published, for clients that never saw it.

vLLM returns `kv_transfer_params` only on non-streaming responses, so a streaming agent gets no
advisory back. The scheduler keeps, per (tenant, session_id), the `kvci` object it would have
returned, and the control surface's `advisory` action hands it over. Per-run state, as the seed
asks of the verdict: one tenant's session never reads another's. Bounded: the least recently
published sessions go first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_SESSIONS = 4096


@dataclass(frozen=True)
class PublishedVerdict:
    kvci: dict[str, Any]  # the response's kv_transfer_params.kvci, as a non-streaming client gets it
    finished_at: float  # wall-clock time the request finished


class PublishedVerdicts:
    """Written by the scheduler thread, read by the control surface's threads."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self._max = max_sessions
        self._lock = threading.Lock()
        self._latest: OrderedDict[tuple[str, str], PublishedVerdict] = OrderedDict()

    def publish(self, tenant: str, session_id: str, kvci: dict[str, Any]) -> None:
        verdict = PublishedVerdict(kvci=kvci, finished_at=time.time())
        with self._lock:
            self._latest[(tenant, session_id)] = verdict
            self._latest.move_to_end((tenant, session_id))
            while len(self._latest) > self._max:
                self._latest.popitem(last=False)

    def latest(self, tenant: str, session_id: str) -> PublishedVerdict | None:
        with self._lock:
            return self._latest.get((tenant, session_id))
