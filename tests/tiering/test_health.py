"""A dependency's health and the bounded calls in front of it (real threads, a real probe): a
failure degrades it once per incident, calls skip it while degraded, a probe off the caller's
thread brings it back, and a call that does not answer costs its caller the timeout once."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvci_plugin.tiering.health import (
    BoundedCalls,
    DependencyHealth,
    TierUnavailableError,
    fault_kind,
)


class Dependency:
    """Something that answers, or not, as a test says; the probe asks it."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.up.set()
        self.probes = 0

    def probe(self) -> None:
        self.probes += 1
        if not self.up.is_set():
            raise ConnectionError("refused")


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_failure_degrades_until_a_probe_finds_it_back_and_is_logged_once(caplog) -> None:
    dep = Dependency()
    health = DependencyHealth("catalog", dep.probe, first_probe_s=0.02, max_probe_s=0.05)
    dep.up.clear()
    with caplog.at_level(logging.WARNING, logger="kvci_plugin"):
        health.failed(ConnectionError("refused"), "a lookup")
        health.failed(ConnectionError("refused"), "a lookup")  # the same incident
        assert not health.available
        wait_for(lambda: dep.probes >= 3)  # probed, with backoff, while it stays down
        assert not health.available
        dep.up.set()
        wait_for(lambda: health.available)
    report = health.report()
    assert (report.state, report.failures, report.incidents, report.last_error) == (
        "healthy", 2, 1, None)
    unavailable = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(unavailable) == 1
    assert any("answers again" in r.getMessage() for r in caplog.records)
    health.close()


def test_a_call_that_does_not_answer_costs_the_timeout_once_then_is_skipped() -> None:
    dep = Dependency()
    health = DependencyHealth("blobs", dep.probe, first_probe_s=0.02, max_probe_s=0.05)
    calls = BoundedCalls(health, 0.2)
    stuck = threading.Event()
    ran_late = []
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            calls.run("a frozen read", stuck.wait)
        # The timeout, not the stuck call's forever (bounded loosely: the machine is shared).
        assert 0.2 <= time.monotonic() - t0 < 10.0
        assert health.report().state == "degraded"
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError):
            calls.run("a lookup", lambda: ran_late.append(1))
        assert time.monotonic() - t0 < 0.15  # not queued behind the stuck call (0.2 s)
        # An operator's action is tried, bounded; one queued behind the stuck call never runs.
        with pytest.raises(TimeoutError):
            calls.run("a reset", lambda: ran_late.append(2), when_degraded=True)
        stuck.set()
        wait_for(lambda: health.available)
        assert calls.run("a lookup", lambda: 7) == 7
        assert ran_late == []
    finally:
        stuck.set()
        calls.close()


def test_a_call_made_inside_a_call_runs_directly() -> None:
    health = DependencyHealth("catalog", lambda: None)
    calls = BoundedCalls(health, 0.5)
    try:
        assert calls.run("outer", lambda: calls.run("inner", lambda: 3) + 1) == 4
        with calls.direct():  # start-up's unbounded work, on the caller's thread
            assert calls.run("x", threading.current_thread) is threading.current_thread()
    finally:
        calls.close()


def test_fault_kinds_follow_the_cause() -> None:
    try:
        try:
            raise ConnectionRefusedError("no server")
        except OSError as exc:
            raise RuntimeError("reading a blob") from exc
    except RuntimeError as wrapped:
        assert fault_kind(wrapped) == "unavailable"
    assert fault_kind(TimeoutError("slow")) == "timeout"
    assert fault_kind(KeyError("a kvci bug")) == "internal"
