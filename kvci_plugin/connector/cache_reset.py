"""Cache resets on the scheduler side: vLLM's `reset_cache`, and one asked from another thread.

A reset (the documented step after an in-place weight update) makes sure no KV computed before
it is loaded after it (`TieredCheckpointManager.reset`). It runs on the scheduler's thread:
vLLM's `reset_cache` calls it there, and the control surface's `reset` (or the workers' report of
a release of the KV cache) only asks for one, which the scheduler's thread applies at its next
hook — before the next lookup, and after the jobs of a step already planned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from kvci_plugin.connector import counters as c
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import ResetOutcome

logger = logging.getLogger(__name__)


class CacheResets:
    """Applies resets (scheduler thread) and takes the ones asked from other threads.
    ``on_reset`` moves the scheduler side to the new generation, under the manager's lock."""

    def __init__(self, *, manager: TieredCheckpointManager, stats: c.Counts,
                 on_reset: Callable[[ResetOutcome], None]) -> None:
        self._manager = manager
        self._stats = stats
        self._on_reset = on_reset
        self._asked: Future[ResetOutcome] | None = None
        self.disk_suspended = False  # a reset failed to fence the disk tier

    def reset(self) -> ResetOutcome:
        """A reset now (scheduler thread). Requests in flight were keyed in the old generation:
        they neither hit nor keep. Queued RAM copies still run (vLLM frees their blocks once
        they have), but what they copy is never loadable."""
        with self._manager.lock:
            try:
                outcome = self._manager.reset()
            except Exception:
                # RAM is empty, but the disk tier's generation could not move: its KV from
                # before stays unloadable here until a reset succeeds.
                self.disk_suspended = True
                self._stats.count(c.CACHE_RESET_FAILURES)
                raise
            self.disk_suspended = False
            self._on_reset(outcome)
        self._stats.count(c.CACHE_RESETS)
        self._stats.count(c.CHECKPOINTS_FENCED, outcome.ram_checkpoints + outcome.disk_checkpoints)
        logger.info("kvci: cache reset: generation %d; fenced %d RAM and %d disk checkpoints",
                    outcome.generation, outcome.ram_checkpoints, outcome.disk_checkpoints)
        return outcome

    def ask(self) -> Future[ResetOutcome]:
        """A reset asked from another thread, applied by the scheduler's thread at its next hook;
        asked again before then, the same future."""
        with self._manager.lock:
            if self._asked is None or self._asked.done():
                self._asked = Future()
            return self._asked

    @property
    def pending(self) -> bool:
        """Whether a reset was asked and not yet applied."""
        return self._asked is not None and not self._asked.done()

    def apply_asked(self) -> None:
        """The scheduler's thread applies the reset asked since its last hook, if any."""
        asked = self._asked
        if asked is None or asked.done():
            return
        try:
            asked.set_result(self.reset())
        except Exception as exc:  # told to the caller that asked; the engine goes on
            logger.exception("kvci: cache reset failed")
            asked.set_exception(exc)
