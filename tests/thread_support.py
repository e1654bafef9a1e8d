"""A call on a thread of its own, for the tests of what must not block: `in_background` starts it
and hands back what it returned or raised once it has, `within` fails the test if it has not
returned in time (real blocking I/O: a FIFO, a frozen server, a held lock)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_background(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """``call()`` on a daemon thread, started; the thread, and a list that holds what the call
    returned or raised once the thread has ended."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def within(seconds: float, call: Callable[[], object]) -> object:
    """What ``call`` returned or raised, on a thread; fails if it is still running after
    ``seconds`` (the thread is left to the cleanup of the test that hung it)."""
    thread, outcome = in_background(call)
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return outcome[0]
