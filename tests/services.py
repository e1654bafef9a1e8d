"""Real PostgreSQL and Redis servers on loopback for the shared-tier tests.

Each is started once per test session in a temporary folder on a free port, and stopped (and
its folder removed) when the session ends. `make setup` installs them (Debian's `postgresql`
and `redis-server`); a missing server fails the tests that need it, it does not skip them.
PostgreSQL refuses to run as root, so when the tests run as root the cluster belongs to the
`postgres` system user the package creates.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: run `make setup` (apt postgresql)")
    return Path(found[-1]).parent


def _as_postgres_user() -> tuple[list[str], int | None]:
    """The command prefix that runs as the cluster owner, and its uid (None: ourselves)."""
    if os.geteuid() != 0:
        return [], None
    return ["runuser", "-u", "postgres", "--"], pwd.getpwnam("postgres").pw_uid


def _wait(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except Exception as exc:  # not up yet: retry until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start: {exc}") from exc
            time.sleep(0.2)


def _stop(server: subprocess.Popen, folder: Path) -> None:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL cluster; yields the URL of its `postgres` database."""
    bindir = _postgres_bin()
    prefix, uid = _as_postgres_user()
    folder = Path(tempfile.mkdtemp(prefix="kvci-pg-"))
    data, sockets = folder / "data", folder / "run"
    sockets.mkdir()
    if uid is not None:
        for path in (folder, sockets):
            os.chown(path, uid, -1)
    port = free_port()
    subprocess.run(
        [*prefix, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "kvci",
         "--no-sync", "-E", "UTF8"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    server = subprocess.Popen(
        [*prefix, str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
         "-k", str(sockets), "-c", "fsync=off", "-c", "max_connections=200"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"postgresql://kvci@127.0.0.1:{port}/postgres"
    try:
        _wait(lambda: psycopg.connect(url, connect_timeout=2).close(), "PostgreSQL")
        yield url
    finally:
        _stop(server, folder)


def new_database(server_url: str) -> str:
    """A new empty database on the server; returns its URL."""
    name = f"kvci_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + f"/{name}"


@contextmanager
def redis_server() -> Iterator[str]:
    """A fresh Redis server with AOF persistence (fsync every write); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("Redis is not installed: run `make setup` (apt redis-server)")
    folder = Path(tempfile.mkdtemp(prefix="kvci-redis-"))
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}"
    try:
        _wait(lambda: redis.Redis.from_url(url).ping(), "Redis")
        yield url
    finally:
        _stop(server, folder)


def new_redis_db(server_url: str, counter: list[int]) -> str:
    """A flushed Redis database of the server (16 per server, reused in turn)."""
    db = counter[0] % 16
    counter[0] += 1
    url = f"{server_url}/{db}"
    redis.Redis.from_url(url).flushdb()
    return url


@contextmanager
def redis_server_process() -> Iterator[tuple[str, subprocess.Popen]]:
    """A fresh Redis server of one's own (no persistence), with its process: a test may freeze
    it (SIGSTOP) without touching the session's server. Yields (URL, process); a frozen server
    is thawed before it is stopped."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("Redis is not installed: run `make setup` (apt redis-server)")
    folder = Path(tempfile.mkdtemp(prefix="kvci-redis-"))
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}"
    try:
        _wait(lambda: redis.Redis.from_url(url).ping(), "Redis")
        yield url, server
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
        _stop(server, folder)
