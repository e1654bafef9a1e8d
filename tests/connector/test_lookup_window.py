"""The lookup window: a control action runs at once outside a step's lookups, and inside them
waits for the step's loads to be planned (or, if the step never ends, for its timeout)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvci_plugin.connector.lookup_window import LookupWindow


def test_outside_a_step_an_action_runs_at_once_on_the_callers_thread() -> None:
    window = LookupWindow(threading.RLock())
    assert window.run(threading.current_thread) is threading.current_thread()


def test_inside_a_step_an_action_waits_for_the_close_and_runs_once() -> None:
    window = LookupWindow(threading.RLock())
    ran: list[str] = []
    assert window.open() and not window.open()  # the step's first lookup, then a second
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(window.run, lambda: ran.append(threading.current_thread().name) or 7)
        with pytest.raises(TimeoutError):
            asked.result(timeout=0.2)
        assert ran == []  # not between two lookups
        window.close()
        assert asked.result(timeout=5) == 7
    assert ran == [threading.current_thread().name]  # on the thread that closed the window
    window.close()
    assert len(ran) == 1
    assert window.open()  # the next step's first lookup


def test_an_actions_failure_reaches_its_caller() -> None:
    window = LookupWindow(threading.RLock())
    window.open()

    def fails() -> None:
        raise RuntimeError("catalog down")

    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(window.run, fails)
        assert _asked(window)
        window.close()
        with pytest.raises(RuntimeError, match="catalog down"):
            asked.result(timeout=5)


def test_a_step_that_never_ends_does_not_block_the_action_past_its_timeout(caplog) -> None:
    window = LookupWindow(threading.RLock(), timeout_s=0.1)
    ran: list[int] = []
    window.open()
    assert window.run(lambda: ran.append(1) or "applied") == "applied"
    assert "no engine step ended" in caplog.text
    window.close()
    assert ran == [1]  # not applied a second time by a late close


def _asked(window: LookupWindow) -> bool:
    """Waits until the action is queued (the caller's thread got there)."""
    for _ in range(500):
        if window._asked:
            return True
        threading.Event().wait(0.01)
    return False
