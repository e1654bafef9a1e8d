"""The worker's copies of running requests' window pages (a sliding-window group's pages at a
prefill boundary, ``window_stages.py`` on the scheduler side), from queued to reported.

Their blocks are the request's until the next step's scheduling frees and hands them out again,
so the next step's writes (issued on the current stream) wait for each copy (``hold``). They are
never reported through ``finished_sending``: that would free a running request's blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.jobs import StoreJob, WorkerReport
from kvci_plugin.ops import PendingCopy


class WindowCopies:
    """Window copies in flight, by stage id."""

    def __init__(self, contain: Containment) -> None:
        self._contain = contain
        self._pending: dict[str, PendingCopy] = {}

    def start(self, jobs: list[StoreJob], copy_out: Callable[[StoreJob], PendingCopy],
              hold: Callable[[PendingCopy], None], report: WorkerReport,
              timed: list[tuple[str, PendingCopy]]) -> None:
        """Queue this step's window copies (one that fails to start is reported failed: the
        scheduler drops its stage), then report those that have run."""
        for job in jobs:
            try:
                pending = copy_out(job)
                hold(pending)
            except Exception as exc:  # not kept: the scheduler drops the stage
                self._contain.fault("storing pages", exc)
                report.window_failed.append(job.checkpoint_id)
                continue
            self._pending[job.checkpoint_id] = pending
            timed.append(("store", pending))
        self.finish(report)

    def finish(self, report: WorkerReport) -> None:
        """Report the window copies that have run (on the CPU: at once)."""
        if not self._pending:
            return
        for sid, pending in list(self._pending.items()):
            try:
                done = pending.done()
            except Exception as exc:
                self._contain.fault("storing pages", exc)
                report.window_failed.append(sid)
                del self._pending[sid]
                continue
            if done:
                report.window_stored[sid] = 1
                del self._pending[sid]
