"""One request's engine calls, and a hang's end: what a served request's steps were (``Served``),
an engine that failed a call (``EngineDied``), and the watchdog that kills an engine core whose
``step()`` call outlasts the hang bound (``Watchdog``, ``kill_engine``)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.faultsim.logs import say


@dataclass
class Served:
    sent: float
    ttft: float | None
    out: Any
    steps: list[tuple[float, float]]  # each step() call: (start, seconds), perf_counter


class EngineDied(Exception):
    """The engine failed a call; ``sent`` and ``steps`` are the request in flight's, if any."""

    def __init__(self, message: str, sent: float | None = None,
                 steps: Sequence[tuple[float, float]] = ()) -> None:
        super().__init__(message)
        self.sent, self.steps = sent, list(steps)


class Watchdog(threading.Thread):
    """Kills the engine's core process when one ``step()`` call outlasts ``hang_s`` (the
    benchmark started it; the call then fails and the run reports a hang)."""

    def __init__(self, llm: Any, hang_s: float) -> None:
        super().__init__(name="step-watchdog", daemon=True)
        self._llm, self._hang_s = llm, hang_s
        self.step_started: float | None = None
        self.hung = False
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.5):
            started = self.step_started
            if (
                started is not None
                and time.perf_counter() - started > self._hang_s
                and not self.hung
            ):
                self.hung = True
                say(f"a step has not returned in {self._hang_s:g} s: killing the engine core")
                kill_engine(
                    self._llm,
                    f"a step did not return in {self._hang_s:g} s: the benchmark killed "
                    "the engine core",
                )

    def stop(self) -> None:
        self._stop.set()


def kill_engine(llm: Any, why: str) -> None:
    """Kill the engine's core process and its workers (this benchmark started them), and wake
    the ``step()`` call waiting on the core's output: vLLM's client notices the death but leaves
    that wait blocked."""
    import psutil

    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    for proc in getattr(manager, "processes", []):
        if proc.pid is None:
            continue
        try:
            family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        except psutil.Error:
            continue
        for member in family:
            try:
                member.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    outputs = getattr(client, "outputs_queue", None)
    if outputs is not None:
        outputs.put_nowait(RuntimeError(why))
