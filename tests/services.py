"""Real PostgreSQL and Redis servers on loopback for the shared-tier tests.

Each is started once per test session in a temporary folder on a free port, and stopped (and
its folder removed) when the session ends. `make setup` installs them (Debian's `postgresql`
and `redis-server`); a missing server fails the tests that need it, it does not skip them.
PostgreSQL refuses to run as root, so when the tests run as root the cluster belongs to the
`postgres` system user the package creates.

The servers themselves are `tools/servers.py`'s, which the fault tests
(tests/fault_support.py) and the fault benchmark (benchmarks/fault_replay.py) start too.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tools.servers import (
    PostgresServer,
    RedisServer,
    end_process,
    free_port,
    new_database,
    new_redis_db,
)
from tools.servers import wait_until as _wait

__all__ = ["_stop", "_wait", "free_port", "new_database", "new_redis_db", "postgres_server",
           "redis_server", "redis_server_process"]


def _stop(server: subprocess.Popen, folder: Path) -> None:
    """Stop a server process a test started itself (SIGTERM, then SIGKILL after 30 s) and
    remove its folder."""
    end_process(server)
    shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL cluster; yields the URL of its `postgres` database."""
    with PostgresServer() as server:
        yield server.url


@contextmanager
def redis_server() -> Iterator[str]:
    """A fresh Redis server with AOF persistence (fsync every write); yields its URL."""
    with RedisServer() as server:
        yield server.server_url


@contextmanager
def redis_server_process() -> Iterator[tuple[str, subprocess.Popen]]:
    """A fresh Redis server of one's own (no persistence), with its process: a test may freeze
    it (SIGSTOP) without touching the session's server. Yields (URL, process); a frozen server
    is thawed before it is stopped."""
    with RedisServer(aof=False) as server:
        process = server.process
        try:
            yield server.server_url, process
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
