"""A disk tier whose dependencies did not answer when the engine started.

The engine must not fail to start because kvci's catalog or blob store is down: it starts with
the RAM tier only, and the disk tier is built again off the engine's threads (the tier health's
probe, with its backoff) until its dependencies answer; the scheduler then attaches it between
two steps. Until then lookups never ask it and persists are reported failed, not refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.health import DependencyHealth, HealthReport


class DiskAttach:
    """``build`` makes the disk tier (raising while its dependencies do not answer); the first
    failure, at engine start, is ``first_error``."""

    def __init__(self, build: Callable[[], KVCheckpointStore], first_error: BaseException,
                 **probe_waits: float) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._built: KVCheckpointStore | None = None
        self._closed = False
        self.health = DependencyHealth("disk tier", self._try_build, **probe_waits)
        self.health.failed(first_error, "engine start")

    def _try_build(self) -> None:
        store = self._build()
        with self._lock:
            if self._closed:
                store.close()
                return
            self._built = store

    def take(self) -> KVCheckpointStore | None:
        """The disk tier once it is built (once; None until then and after)."""
        with self._lock:
            store, self._built = self._built, None
            return store

    def report(self) -> HealthReport:
        return self.health.report()

    def close(self) -> None:
        """The engine stops: no more attempts, and a tier built but never taken is closed."""
        self.health.close()
        store = None
        with self._lock:
            self._closed = True
            store, self._built = self._built, None
        if store is not None:
            store.close()
