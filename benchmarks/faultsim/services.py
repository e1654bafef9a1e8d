"""The servers a fault replay starts, faults and stops: a PostgreSQL cluster and a Redis server,
each on loopback in a temporary folder of its own (started the way ``tests/services.py`` starts
the test servers), and the fault window that a thread of its own applies to them.

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

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

FAULTS: dict[str, str] = {
    "pg_stop": "PostgreSQL stopped, then restarted",
    "redis_freeze": "Redis frozen (SIGSTOP), then thawed (SIGCONT)",
    "pg_terminate": "PostgreSQL backends terminated",
    "none": "no fault (control)",
}
DEFAULT_FAULTS = ("pg_stop", "redis_freeze", "pg_terminate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except Exception as exc:  # not up yet: retry until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer: {exc}") from exc
            time.sleep(0.05)


def _end(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class PostgresServer:
    """A fresh cluster (trust authentication, user ``kvci``); ``stop`` and ``start`` keep its
    port and data. PostgreSQL refuses to run as root: as root the cluster belongs to the
    ``postgres`` system user its package creates."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            raise RuntimeError("PostgreSQL is not installed: run `make setup` (apt postgresql)")
        self._bin = Path(found[-1]).parent
        self._prefix: list[str] = []
        uid: int | None = None
        if os.geteuid() == 0:
            self._prefix, uid = ["runuser", "-u", "postgres", "--"], pwd.getpwnam("postgres").pw_uid
        self.folder = Path(tempfile.mkdtemp(prefix="kvci-fault-replay-pg-"))
        self._data, self._sockets = self.folder / "data", self.folder / "run"
        self._sockets.mkdir()
        if uid is not None:
            for path in (self.folder, self._sockets):
                os.chown(path, uid, -1)
        subprocess.run([*self._prefix, str(self._bin / "initdb"), "-D", str(self._data), "-A", "trust",
                        "-U", "kvci", "--no-sync", "-E", "UTF8"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.port = free_port()
        self.url = f"postgresql://kvci@127.0.0.1:{self.port}/postgres"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        import psycopg

        self._proc = subprocess.Popen(
            [*self._prefix, str(self._bin / "postgres"), "-D", str(self._data), "-h", "127.0.0.1",
             "-p", str(self.port), "-k", str(self._sockets), "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait(lambda: psycopg.connect(self.url, connect_timeout=2).close(), "PostgreSQL")

    def stop(self) -> None:
        """Fast shutdown: every session is cut at once, the data is kept."""
        pid_file = self._data / "postmaster.pid"
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
        except (OSError, ValueError, IndexError):
            self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            _end(self._proc, signal.SIGQUIT)

    def new_database(self) -> str:
        """A new empty database; its URL."""
        import uuid

        import psycopg

        name = f"kvci_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def terminate_backends(self, database_url: str) -> int:
        """Terminate every session on the database of ``database_url``; how many there were."""
        import psycopg

        name = database_url.rsplit("/", 1)[1]
        with psycopg.connect(self.url, autocommit=True, connect_timeout=2) as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = %s AND pid <> pg_backend_pid()", (name,)).fetchall()
        return sum(1 for (done,) in rows if done)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class RedisServer:
    """A fresh Redis server (no persistence: the blobs matter only while the run lasts)."""

    def __init__(self) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("Redis is not installed: run `make setup` (apt redis-server)")
        self.folder = Path(tempfile.mkdtemp(prefix="kvci-fault-replay-redis-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "no", "--save", "", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait(lambda: redis.Redis.from_url(self.url).ping(), "Redis")
        self._next_db = 1

    def new_db(self) -> str:
        """A flushed database of the server (0 is left alone; 1-15 in turn)."""
        import redis

        url = f"{self.url}/{self._next_db}"
        self._next_db = self._next_db % 15 + 1
        redis.Redis.from_url(url).flushdb()
        return url

    def freeze(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def ping(self) -> None:
        import redis

        redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2).ping()

    def close(self) -> None:
        self.thaw()
        _end(self._proc)
        self._proc = None
        shutil.rmtree(self.folder, ignore_errors=True)


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
                    self.terminated_backends += self._pg.terminate_backends(self._catalog_url)
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
                _wait(self._redis.ping, "Redis")
        except Exception as exc:
            self.error = (self.error + "; " if self.error else "") + f"restore: {type(exc).__name__}: {exc}"
        self.answered = time.perf_counter()
        if self.injected is None:
            self.injected = self.restored
        self._say(f"fault {self.kind}: restored, answering again {self.answered - self.injected:.1f} s "
                  "after it began")
