"""The faults a fault replay does to its servers (``tools/servers.py``'s PostgreSQL cluster and
Redis server, which the tests start too), in a fault window that a thread of its own applies, and
the phases (before, during, after) a fault run's requests and steps fall in.

Faults (``FAULTS``):

- ``pg_stop``: PostgreSQL stopped (fast shutdown: every session is cut), then started again on
  the same port and data; it answers again once a connection succeeds.
- ``redis_freeze``: Redis frozen (``SIGSTOP``: connections stay open, nothing answers), then
  thawed (``SIGCONT``); it answers again at the first ``PING`` after the thaw.
- ``pg_terminate``: every backend of kvci's database terminated (``pg_terminate_backend``) at the
  window's start and every ``--terminate-every`` seconds through it: the server answers
  throughout, kvci's sessions are cut under it; it answers again (no more cuts) at the window's end.
- ``none``: nothing is done (a control run of the same engine).

The window runs on its own clock: injected at its time and restored ``fault_s`` later whatever the
engine does, so a wedged engine call cannot hold the dependency down.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.faultsim.report import (
    PHASES,
    EngineRun,
    FaultRun,
    PhaseStats,
    PhaseView,
    Recovery,
    step_phase,
)
from tools.servers import PostgresServer, RedisServer, wait_until

FAULTS: dict[str, str] = {
    "pg_stop": "PostgreSQL stopped, then restarted",
    "redis_freeze": "Redis frozen (SIGSTOP), then thawed (SIGCONT)",
    "pg_terminate": "PostgreSQL backends terminated",
    "none": "no fault (control)",
}
DEFAULT_FAULTS = ("pg_stop", "redis_freeze", "pg_terminate")


class FaultWindow(threading.Thread):
    """One fault, on its own thread: injected at ``inject_at`` and restored ``fault_s`` later
    (``time.perf_counter`` readings). ``injected``, ``restored`` and ``answered`` are the times it
    began, was undone and the dependency answered again; ``error`` what went wrong applying it."""

    def __init__(self, kind: str, pg: PostgresServer, redis: RedisServer, catalog_url: str,
                 inject_at: float, fault_s: float, terminate_every_s: float,
                 say: Callable[[str], None]) -> None:
        super().__init__(name=f"fault-{kind}", daemon=True)
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        self.kind = kind
        self._pg, self._redis, self._catalog_url = pg, redis, catalog_url
        self._inject_at, self._fault_s, self._every_s = inject_at, fault_s, terminate_every_s
        self._say = say
        self._abort = threading.Event()
        self.injected: float | None = None
        self.restored: float | None = None
        self.answered: float | None = None
        self.terminated_backends = 0
        self.error: str | None = None

    def abort(self) -> None:
        """Restore now (the run ended early)."""
        self._abort.set()

    def run(self) -> None:
        try:
            if self._abort.wait(max(0.0, self._inject_at - time.perf_counter())):
                return  # over before it began: nothing to undo
            began = time.perf_counter()
            end = began + self._fault_s
            if self.kind == "pg_stop":
                self._pg.stop()
            elif self.kind == "redis_freeze":
                self._redis.freeze()
            self.injected = time.perf_counter()  # down from now on (a fast shutdown takes a moment)
            self._say(f"fault {self.kind}: injected for {self._fault_s:g} s")
            if self.kind == "pg_terminate":
                while True:
                    self.terminated_backends += self._pg.terminate_connections(self._catalog_url)
                    left = end - time.perf_counter()
                    if left <= 0 or self._abort.wait(min(self._every_s, left)):
                        break
            self._abort.wait(max(0.0, end - time.perf_counter()))
        except Exception as exc:  # reported; the restore below still runs
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.injected is not None or self.error is not None:
                self._restore()

    def _restore(self) -> None:
        self.restored = time.perf_counter()
        try:
            if self.kind == "pg_stop":
                self._pg.start()
            elif self.kind == "redis_freeze":
                self._redis.thaw()
                wait_until(self._redis.ping, "Redis")
        except Exception as exc:
            self.error = (
                self.error + "; " if self.error else ""
            ) + f"restore: {type(exc).__name__}: {exc}"
        self.answered = time.perf_counter()
        if self.injected is None:
            self.injected = self.restored
        self._say(
            f"fault {self.kind}: restored, answering again {self.answered - self.injected:.1f} s "
            "after it began"
        )


def phase_of(at_s: float, injected: float | None, answered: float | None) -> str:
    if injected is None or at_s < injected:
        return "before"
    if answered is None or at_s < answered:
        return "during"
    return "after"


def fault_run(kind: str, window: FaultWindow, run: EngineRun, anchor: EngineRun, floor: EngineRun,
              t0_of: float) -> FaultRun:
    rel = lambda t: None if t is None else round(t - t0_of, 3)  # noqa: E731
    injected, restored, answered = rel(window.injected), rel(window.restored), rel(window.answered)
    samples = [s.model_copy(update={"phase": phase_of(s.sent_s if s.sent_s is not None else s.due_s,
                                                       injected, answered)}) for s in run.samples]
    run = run.model_copy(update={"samples": samples})
    by_phase = {p: [s.index for s in samples if s.phase == p] for p in PHASES}
    phases = {}
    for p, indices in by_phase.items():
        # Called within this iteration only: its loop variables are this phase's (B023).
        def stats(r: EngineRun) -> PhaseStats:
            return PhaseStats.of(
                [r.samples[i] for i in indices if i < len(r.samples)],  # noqa: B023
                [(t, d) for t, d in r.steps if step_phase(t, d, injected, answered) == p],  # noqa: B023
            )

        phases[p] = PhaseView.of(stats(run), stats(anchor), stats(floor))
    after = [s for s in samples if s.phase == "after" and s.sent_s is not None]
    first = next(
        (n for n, s in enumerate(after) if s.hit_tier == "disk" and s.kvci_tokens > 0), None
    )
    recovery = Recovery(
        first_disk_hit_s=None
        if first is None or answered is None
        else round(after[first].sent_s - answered, 3),
        requests_before_first_disk_hit=first,
        disk_hits_during=sum(
            s.hit_tier == "disk" and s.kvci_tokens > 0 for s in samples if s.phase == "during"
        ),
    )
    return FaultRun(
        fault=kind,
        description=FAULTS[kind],
        injected_at_s=injected,
        restored_at_s=restored,
        answered_at_s=answered,
        fault_error=window.error,
        terminated_backends=window.terminated_backends,
        run=run,
        phases=phases,
        recovery=recovery,
    )


class ScheduledWindow(FaultWindow):
    """A fault window whose clock starts with the measured slice."""

    def __init__(self, *args: Any, inject_due: float, **kwargs: Any) -> None:
        super().__init__(*args, inject_at=math.inf, **kwargs)
        self._inject_due = inject_due
        self.t0: float | None = None

    def start_at(self, t0: float) -> None:
        self.t0 = t0
        self._inject_at = t0 + self._inject_due
        self.start()

    def abort_at_end(self) -> None:
        """The slice is over (or the engine died): restore now if the window still holds."""
        if self.is_alive():
            self.abort()
        if self.t0 is not None:
            self.join(timeout=120)
