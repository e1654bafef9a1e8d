"""The lookup window: where a control action that takes pages from the RAM tier may land.

vLLM looks requests up, allocates their blocks and has kvci plan (and pin) their loads in one
`schedule()` call, which always ends with `build_connector_meta`. A forget that landed between
a lookup and its pin would take pages vLLM has already counted on; with several KV cache groups
vLLM cannot even recompute such a load (it refuses block-level load errors there). So an action
asked while a step's lookups are open waits for that step's loads to be planned — what is pinned
by then is still read by the step, and nothing after it — and one asked outside runs at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LookupWindow:
    """Opened by the scheduler thread at a step's first lookup and closed when the step's jobs
    are built; ``run`` applies a control thread's action outside it, under ``lock``."""

    def __init__(self, lock: threading.RLock, timeout_s: float = 10.0) -> None:
        self._lock = lock
        self._timeout_s = timeout_s  # a step that never ends (a dead engine) does not block it
        self._open = False
        self._asked: list[tuple[Callable[[], Any], Future[Any]]] = []

    def open(self) -> bool:
        """A lookup begins (scheduler thread); whether it is the step's first."""
        with self._lock:
            first, self._open = not self._open, True
            return first

    def close(self) -> None:
        """The step's loads are planned (scheduler thread): what was asked meanwhile runs now."""
        with self._lock:
            self._open = False
            asked, self._asked = self._asked, []
            for action, future in asked:
                try:
                    future.set_result(action())
                except Exception as exc:  # the caller's to report
                    future.set_exception(exc)

    def run(self, action: Callable[[], T]) -> T:
        """Apply ``action`` (another thread) now if no lookup is open, else once the step's loads
        are planned; its exception is raised here."""
        asked: tuple[Callable[[], Any], Future[Any]]
        with self._lock:
            if not self._open:
                return action()
            asked = (action, Future())
            self._asked.append(asked)
        try:
            return asked[1].result(timeout=self._timeout_s)
        except FutureTimeout:
            pass
        with self._lock:
            if asked in self._asked:  # the step never ended: the engine is stuck or gone
                self._asked.remove(asked)
                logger.warning("kvci: no engine step ended in %g s; applying a control action "
                               "with a lookup open", self._timeout_s)
                return action()
        return asked[1].result()
