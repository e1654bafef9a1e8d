"""Real PostgreSQL and Redis servers on loopback, each of one's own, for the tests and the
benchmarks: the test session's shared servers (``tests/services.py``), the private servers the
fault tests stop, freeze and cut off (``tests/fault_support.py``), and the fault replay's
(``benchmarks/fault_replay.py``, ``benchmarks/faultsim/windows.py``). Not a script: imported as
``tools.servers`` (the repository root is on the path of both: pytest's ``pythonpath``, and
``python -m benchmarks...`` run from the root), so that neither imports the other's code.

Each server runs in a temporary folder of its own on a free port, in a session of its own (a
signal to the caller's process group does not reach it): ``stop()`` and ``start()`` keep its port
and data, ``freeze()`` / ``thaw()`` stop and continue it (SIGSTOP / SIGCONT: connections stay
open, nothing answers), ``close()`` stops it and removes its folder (so does leaving a ``with``
block). `make setup` installs both (Debian's ``postgresql`` and ``redis-server``): a missing one
raises, it is not skipped. PostgreSQL refuses to run as root, so as root the cluster belongs to
the ``postgres`` system user the package creates.
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
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Call ``check`` until it returns without raising; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except Exception as exc:  # not up yet: retry until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer: {exc}") from exc
            time.sleep(0.05)


def end_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM,
                timeout_s: float = 30.0) -> None:
    """Send ``sig`` to a process that still runs and wait for it; killed if it outlasts
    ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: run `make setup` (apt postgresql)")
    return Path(found[-1]).parent


def as_postgres_user() -> tuple[list[str], int | None]:
    """The command prefix that runs as the cluster owner, and its uid (None: ourselves)."""
    if os.geteuid() != 0:
        return [], None
    return ["runuser", "-u", "postgres", "--"], pwd.getpwnam("postgres").pw_uid


class _Server:
    """A server process of one's own in ``folder``, on ``port``; see the module's docstring."""

    STOP_SIGNAL = signal.SIGTERM

    def __init__(self, folder_prefix: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=folder_prefix))
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._frozen = False

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the server is stopped"
        return self._proc.pid

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, "the server is stopped"
        return self._proc

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        raise NotImplementedError

    def _first_start(self) -> None:
        """``start()``; should the server not answer, it is closed (nothing is left running)."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def _launch(self, argv: list[str], answers: Callable[[], object], what: str,
                **popen: Any) -> None:
        """Start ``argv`` in a session of its own; returns once ``answers()`` succeeds."""
        assert not self.running
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True, **popen)
        wait_until(answers, what)

    def stop(self) -> None:
        """``STOP_SIGNAL`` (thawed first), the folder kept; the process group is killed if the
        server has not exited within 30 s."""
        if self._proc is None:
            return
        self.thaw()
        if self._proc.poll() is None:
            self._proc.send_signal(self.STOP_SIGNAL)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._proc.wait(30)
        self._proc = None

    def _processes(self) -> list[int]:
        """The processes ``freeze`` stops."""
        return [self.pid]

    def freeze(self) -> None:
        """SIGSTOP the server: connections hang, none is refused."""
        self._frozen = True
        for pid in self._processes():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass

    def thaw(self) -> None:
        if self._frozen and self._proc is not None:
            for pid in self._processes():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self._frozen = False

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PostgresServer(_Server):
    """A fresh PostgreSQL cluster (trust authentication, user ``kvci``); ``url`` is its
    ``postgres`` database's. ``stop()`` is a fast shutdown (every session is terminated);
    ``freeze()`` stops the postmaster and every backend."""

    STOP_SIGNAL = signal.SIGINT

    def __init__(self) -> None:
        super().__init__("kvci-pg-")
        self._bindir = postgres_bin()
        prefix, self._uid = as_postgres_user()
        self._gid = None if self._uid is None else pwd.getpwuid(self._uid).pw_gid
        self._data, self._sockets = self.folder / "data", self.folder / "run"
        self._sockets.mkdir()
        if self._uid is not None:
            for path in (self.folder, self._sockets):
                os.chown(path, self._uid, self._gid)
        subprocess.run(
            [*prefix, str(self._bindir / "initdb"), "-D", str(self._data), "-A", "trust", "-U",
             "kvci", "--no-sync", "-E", "UTF8"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"postgresql://kvci@127.0.0.1:{self.port}/postgres"
        self._first_start()

    def start(self) -> None:
        """Start the server on its data folder and port; returns once it answers. The
        postmaster is run directly (not through runuser), so that ``pid`` is its own."""
        import psycopg

        user = {} if self._uid is None else {"user": self._uid, "group": self._gid,
                                              "extra_groups": []}
        self._launch(
            [str(self._bindir / "postgres"), "-D", str(self._data), "-h", "127.0.0.1", "-p",
             str(self.port), "-k", str(self._sockets), "-c", "fsync=off", "-c",
             "max_connections=200"],
            lambda: psycopg.connect(self.url, connect_timeout=2).close(), "PostgreSQL", **user)

    def _processes(self) -> list[int]:
        """The postmaster and its children (each backend is a process group of its own)."""
        pids = [self.pid]
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.pid:
                    pids.append(int(entry))
        return pids

    def new_database(self) -> str:
        """A new empty database; its URL."""
        return new_database(self.url)

    def backends(self, database_url: str) -> list[int]:
        """The pids of the sessions on the database of ``database_url``, but this call's own."""
        import psycopg

        name = database_url.rsplit("/", 1)[1]
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s "
                                "AND pid <> pg_backend_pid()", (name,)).fetchall()
        return [r[0] for r in rows]

    def terminate_connections(self, database_url: str) -> int:
        """The server terminates every session on that database but this call's own (as an
        administrator or a failover does); how many it terminated."""
        import psycopg

        name = database_url.rsplit("/", 1)[1]
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                "AND pid <> pg_backend_pid()", (name,)).fetchall()
        return sum(1 for (done,) in rows if done)


def new_database(server_url: str) -> str:
    """A new empty database on the server; returns its URL."""
    import psycopg

    name = f"kvci_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + f"/{name}"


class RedisServer(_Server):
    """A fresh Redis server; ``server_url`` is the server's (no database), ``url`` its database
    0's. With ``aof`` (the default) every write is appended and fsynced, so data survives
    ``stop()`` (SIGTERM: Redis syncs and exits) and ``start()``; without, nothing is kept."""

    def __init__(self, aof: bool = True) -> None:
        super().__init__("kvci-redis-")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("Redis is not installed: run `make setup` (apt redis-server)")
        self._binary = binary
        self._aof = aof
        self.server_url = f"redis://127.0.0.1:{self.port}"
        self.url = f"{self.server_url}/0"
        self._dbs = [1]  # new_db: database 0 is left alone at first
        self._first_start()

    def start(self) -> None:
        import redis

        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self._aof \
            else ["--appendonly", "no"]
        self._launch(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.folder), *persistence, "--save", "", "--protected-mode", "yes"],
            lambda: redis.Redis.from_url(self.url, socket_timeout=2).ping(), "Redis")

    def client(self) -> Any:
        """A redis-py client of database 0 (5 s socket timeout)."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def ping(self) -> None:
        """Raises unless the server answers within 2 s."""
        import redis

        redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2).ping()

    def new_db(self) -> str:
        """A flushed database of the server (16, reused in turn); its URL."""
        return new_redis_db(self.server_url, self._dbs)

    def terminate_connections(self) -> int:
        """The server closes every client connection but this call's own (as a restart of a
        proxy or a `timeout` setting does); how many it closed."""
        with self.client() as client:
            return int(client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))


def new_redis_db(server_url: str, counter: list[int]) -> str:
    """A flushed Redis database of the server (16 per server, reused in turn: ``counter`` holds
    the next one)."""
    import redis

    db = counter[0] % 16
    counter[0] += 1
    url = f"{server_url}/{db}"
    redis.Redis.from_url(url).flushdb()
    return url
