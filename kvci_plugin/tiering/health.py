"""A dependency's health: healthy → degraded on a failure → probed off the caller's thread with
backoff → healthy again by itself when the dependency answers.

A tier that depends on a catalog database, a blob store or a shared folder asks its health
before each call on the engine's step: while degraded, lookups skip the tier at once (a miss)
and writes are dropped, so no engine step waits on a dependency known to be down. The first
failure of an incident is logged with what failed; the ones after it are counted, not logged,
until the dependency is healthy again.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_PROBE_S = 0.5
"""Wait before the first probe after a failure; each failed probe doubles it up to MAX_PROBE_S."""
MAX_PROBE_S = 4.0
"""Longest wait between probes: a dependency that answers again is in use within this (the
README promises hits again within 10 s of it answering)."""


def _dependency_errors() -> tuple[type[BaseException], ...]:
    """What a dependency raises when it is down, slow or full (not a refusal of kvci's own)."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, sqlite3.OperationalError,
                                         sqlite3.DatabaseError]
    try:
        import psycopg

        errors.append(psycopg.OperationalError)
        errors.append(psycopg.errors.QueryCanceled)
        errors.append(psycopg.errors.LockNotAvailable)
        errors.append(psycopg.InterfaceError)
    except ImportError:
        pass
    try:
        import redis

        errors.append(redis.exceptions.ConnectionError)
        errors.append(redis.exceptions.TimeoutError)
        errors.append(redis.exceptions.BusyLoadingError)
        errors.append(redis.exceptions.ReadOnlyError)
    except ImportError:
        pass
    return tuple(errors)


DEPENDENCY_ERRORS: tuple[type[BaseException], ...] = _dependency_errors()


class TierUnavailableError(RuntimeError):
    """A call skipped because its tier's dependency is degraded (no dependency was asked)."""


def fault_kind(exc: BaseException) -> str:
    """``timeout`` (the dependency did not answer in time), ``unavailable`` (it is down, full or
    refused the connection) or ``internal`` (kvci's own fault)."""
    unavailable = False
    seen: BaseException | None = exc
    for _ in range(8):  # the error and what caused it
        if seen is None:
            break
        name = type(seen).__name__.lower()
        if isinstance(seen, TimeoutError) or "timeout" in name or "querycanceled" in name \
                or "locknotavailable" in name:
            return "timeout"
        if isinstance(seen, DEPENDENCY_ERRORS + (TierUnavailableError,)) \
                or name == "blobstoreunavailableerror":
            unavailable = True
        seen = seen.__cause__ or seen.__context__
    return "unavailable" if unavailable else "internal"


@dataclass(frozen=True)
class HealthReport:
    """What the control surface, `kvci doctor` and `ram_stats` show of one dependency."""

    name: str
    state: str  # "healthy" or "degraded"
    failures: int  # failures since the process started
    incidents: int  # healthy -> degraded transitions
    degraded_for_s: float | None  # None while healthy
    last_error: str | None  # type and message of the failure that began this incident


class DependencyHealth:
    """The health of one dependency (a tier's catalog and blob store), shared by the threads
    that call it. ``probe`` asks the dependency something cheap and raises when it does not
    answer; it runs on a thread of its own, never on the caller's."""

    def __init__(self, name: str, probe: Callable[[], object], *,
                 first_probe_s: float = FIRST_PROBE_S, max_probe_s: float = MAX_PROBE_S) -> None:
        self.name = name
        self._probe = probe
        self._first_probe_s = first_probe_s
        self._max_probe_s = max_probe_s
        self._lock = threading.Lock()
        self._healthy = True
        self._since: float | None = None
        self._last_error: str | None = None
        self._failures = 0
        self._incidents = 0
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def available(self) -> bool:
        """False while degraded: skip the dependency (a read of one attribute, no lock)."""
        return self._healthy

    def failed(self, exc: BaseException, what: str) -> None:
        """A call to the dependency failed: degraded until a probe succeeds."""
        with self._lock:
            self._failures += 1
            if not self._healthy:
                return  # this incident is logged already
            self._healthy = False
            self._incidents += 1
            self._since = time.monotonic()
            self._last_error = f"{type(exc).__name__}: {exc}"[:500]
            start = self._prober is None or not self._prober.is_alive()
            if start and not self._closed.is_set():
                self._prober = threading.Thread(target=self._probe_until_healthy,
                                                name=f"kvci-probe-{self.name}", daemon=True)
        logger.warning("kvci: %s unavailable (%s, in %s): skipped (lookups miss, writes are "
                       "dropped) and probed in the background until it answers",
                       self.name, self._last_error, what)
        if start and self._prober is not None and not self._closed.is_set():
            self._prober.start()

    def _probe_until_healthy(self) -> None:
        wait = self._first_probe_s
        while not self._closed.wait(wait):
            try:
                self._probe()
            except Exception as exc:  # still down: probe again later
                logger.debug("kvci: %s probe failed: %s", self.name, exc)
                wait = min(wait * 2, self._max_probe_s)
                continue
            with self._lock:
                degraded_s = time.monotonic() - (self._since or time.monotonic())
                self._healthy, self._since = True, None
            logger.warning("kvci: %s answers again after %.1f s: in use again", self.name,
                           degraded_s)
            return

    def report(self) -> HealthReport:
        with self._lock:
            return HealthReport(
                name=self.name, state="healthy" if self._healthy else "degraded",
                failures=self._failures, incidents=self._incidents,
                degraded_for_s=(None if self._since is None
                                else round(time.monotonic() - self._since, 3)),
                last_error=None if self._healthy else self._last_error)

    def close(self) -> None:
        """Stop probing (the tier is closing)."""
        self._closed.set()


# One call handed to a bounded-call thread: its future, the function and its arguments.
_Call = tuple[Future[object], Callable[..., object], tuple[object, ...], dict[str, object]]


class BoundedCalls:
    """Runs a dependency's calls on a thread of its own and waits at most ``timeout_s`` for
    each: a frozen server (SIGSTOP answers nothing, and a server-side statement timeout never
    fires) or a hard-mounted NFS folder then costs the caller — the engine's step — that long
    once, the dependency is marked degraded, and later calls skip it without waiting. A call
    made from within a call runs directly (one thread: waiting for itself would deadlock).

    A call that timed out still holds the thread until the dependency answers; calls queued
    behind it time out too, and one that never started is cancelled, so nothing runs late."""

    def __init__(self, health: DependencyHealth, timeout_s: float) -> None:
        if not (timeout_s > 0 and timeout_s != float("inf")):
            raise ValueError(f"timeout_s must be > 0 and finite, not {timeout_s!r}")
        self.health = health
        self.timeout_s = float(timeout_s)
        # A daemon thread, not an executor's: a call stuck on a frozen server must not hold up
        # the process's exit (an executor's threads are joined at exit).
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._inside = threading.local()
        self._thread = threading.Thread(
            target=self._serve, name=f"kvci-calls-{health.name}", daemon=True
        )
        self._thread.start()

    def run(
        self,
        what: str,
        fn: Callable[..., T],
        *args: object,
        when_degraded: bool = False,
        **kwargs: object,
    ) -> T:
        """``fn(*args, **kwargs)``; ``TierUnavailableError`` at once while degraded (unless
        ``when_degraded``: an operator's reset or forget is tried whatever the health);
        ``TimeoutError`` past the timeout. A dependency's failure marks it degraded."""
        if getattr(self._inside, "yes", False):
            return fn(*args, **kwargs)
        if not when_degraded and not self.health.available:
            raise TierUnavailableError(f"{self.health.name} is degraded: {what} skipped")
        future: Future[T] = Future()
        self._queue.put((future, fn, args, kwargs))  # type: ignore[arg-type]
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()
            exc = TimeoutError(f"{what} did not end within {self.timeout_s:g} s")
            self.health.failed(exc, what)
            raise exc from None
        except DEPENDENCY_ERRORS as exc:
            self.health.failed(exc, what)
            raise

    @contextmanager
    def direct(self) -> Iterator[None]:
        """Calls made inside run on this thread, unbounded (start-up's reconcile, whose
        length grows with the tier and which an engine waits for anyway)."""
        was = getattr(self._inside, "yes", False)
        self._inside.yes = True
        try:
            yield
        finally:
            self._inside.yes = was

    def _serve(self) -> None:
        self._inside.yes = True
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue  # timed out before it started: it never runs
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, raised there
                future.set_exception(exc)

    def close(self) -> None:
        """Stop the probe and the thread once its calls are done; nothing waits for a call
        still stuck."""
        self.health.close()
        self._queue.put(None)
