"""Every wait of the disk tier on a dependency is bounded, and a PostgreSQL connection the server
ended is reopened (real PostgreSQL, Redis and SQLite; a frozen Redis of the test's own)."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import torch
from services import redis_server_process
from thread_support import within

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.tiering.blobs.errors import BlobStoreUnavailableError, BlobUnavailableError
from kvci_plugin.tiering.blobs.redis_store import RedisBlobRoot
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.disk.db import _WRITE_LOCK_ID, PostgresDatabase, SQLiteDatabase
from kvci_plugin.tiering.timeouts import DependencyTimeouts

NS = hashlib.sha256(b"timeouts-ns").digest()
KEY = bytes(range(16))


# ---- the settings --------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["connect_s", "statement_s", "lock_s", "blob_s"])
@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "2"])
def test_a_timeout_is_a_finite_positive_number_of_seconds(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a finite number of seconds > 0"):
        DependencyTimeouts(**{field: value})  # type: ignore[arg-type]


def test_the_configuration_hands_its_timeouts_to_the_tier() -> None:
    assert KVCIConfig().dependency_timeouts() == DependencyTimeouts()
    config = KVCIConfig.from_extra_config({"timeouts": {"lock_s": 0.5, "blob_s": 3}})
    assert config.dependency_timeouts() == DependencyTimeouts(lock_s=0.5, blob_s=3.0)
    for bad in ({"lock_s": 0}, {"blob_s": -1}, {"statement_s": "inf"}, {"connect_s": "nan"},
                {"read_s": 1.0}):
        with pytest.raises(ValueError, match="timeouts"):
            KVCIConfig.from_extra_config({"timeouts": bad})


def test_postgres_counts_a_connect_timeout_in_whole_seconds_of_at_least_two() -> None:
    assert DependencyTimeouts(connect_s=0.1).postgres_connect_s == 2
    assert DependencyTimeouts(connect_s=2.5).postgres_connect_s == 3


# ---- PostgreSQL ----------------------------------------------------------------------------


def test_a_slow_catalog_statement_is_cancelled(pg_catalog_url: str) -> None:
    db = PostgresDatabase(pg_catalog_url, DependencyTimeouts(statement_s=0.3))
    started = time.monotonic()
    with pytest.raises(psycopg.errors.QueryCanceled), db.read() as tx:
        tx.execute("SELECT pg_sleep(10)")
    assert time.monotonic() - started < 3
    with db.read() as tx:  # the connection is still good
        assert tx.execute("SELECT 1 AS one").fetchone() == {"one": 1}
    db.close()


def test_the_wait_for_the_fleet_wide_write_lock_is_bounded(pg_catalog_url: str) -> None:
    """Another node holding the catalog's advisory lock costs a write ``lock_s``, not a stall
    (``statement_s`` is longer here: the lock's own bound ends the wait)."""
    catalog = CheckpointCatalog(url=pg_catalog_url,
                                timeouts=DependencyTimeouts(lock_s=0.3, statement_s=30))
    with psycopg.connect(pg_catalog_url, autocommit=True) as other, other.transaction():
        other.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK_ID,))
        started = time.monotonic()
        failed = within(
            10, lambda: catalog.lease(NS, [KEY], "w", time.time() + 60, tenant="alice"))
        assert isinstance(failed, psycopg.errors.LockNotAvailable), failed
        assert time.monotonic() - started < 3
    # Free again: the same catalog writes.
    catalog.lease(NS, [KEY], "w", time.time() + 60, tenant="alice")
    assert catalog.leased(NS, [KEY]) == {KEY}
    catalog.close()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def test_connecting_to_a_catalog_that_never_answers_is_bounded(silent_server: int) -> None:
    url = f"postgresql://kvci@127.0.0.1:{silent_server}/kvci"
    started = time.monotonic()
    failed = within(15, lambda: PostgresDatabase(url, DependencyTimeouts(connect_s=0.5)))
    assert isinstance(failed, psycopg.OperationalError), failed
    assert time.monotonic() - started < 6  # libpq's floor is 2 s


def _kvci_backend(url: str) -> int:
    """The pid of the server process serving the catalog's connection (the only other
    connection to its database)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()").fetchall()
    assert len(rows) == 1, rows
    return rows[0][0]


def _terminate(url: str, pid: int) -> None:
    """End a backend the way a server restart or an administrator does, and wait until it is
    gone."""
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()[0]


def test_a_connection_the_server_ended_is_reopened_for_the_next_read_and_write(
        pg_catalog_url: str) -> None:
    catalog = CheckpointCatalog(url=pg_catalog_url)
    catalog.lease(NS, [KEY], "w", time.time() + 60, tenant="alice")
    _terminate(pg_catalog_url, _kvci_backend(pg_catalog_url))
    assert catalog.leased(NS, [KEY]) == {KEY}  # a read
    _terminate(pg_catalog_url, _kvci_backend(pg_catalog_url))
    catalog.release("w")  # a write
    assert catalog.leased(NS, [KEY]) == set()
    catalog.close()


def test_nothing_is_run_again_once_the_callers_statements_ran(pg_catalog_url: str) -> None:
    """A connection lost after the caller's statements began fails the call: a retry could
    run them twice. The next call has a new connection."""
    db = PostgresDatabase(pg_catalog_url)
    runs = 0
    with pytest.raises(psycopg.OperationalError), db.write() as tx:
        runs += 1
        tx.execute("SELECT 1")
        _terminate(pg_catalog_url, _kvci_backend(pg_catalog_url))
        tx.execute("SELECT 1")
    assert runs == 1
    with db.read() as tx:
        assert tx.execute("SELECT 1 AS one").fetchone() == {"one": 1}
    db.close()


# ---- SQLite --------------------------------------------------------------------------------


def test_the_embedded_catalog_waits_for_its_file_lock_at_most_blob_s(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite3"
    db = SQLiteDatabase(path, DependencyTimeouts(blob_s=0.2))
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"), db.write():
        pass
    assert time.monotonic() - started < 2  # sqlite3's own default is 5 s
    other.execute("ROLLBACK")
    other.close()
    db.close()


# ---- Redis ---------------------------------------------------------------------------------


def test_a_frozen_redis_is_a_bounded_miss_not_a_bad_blob(tmp_path: Path) -> None:
    """A server that stops answering (SIGSTOP: connections open, nothing said) costs a read
    ``blob_s``, as ``BlobStoreUnavailableError``: the blob is neither quarantined nor reported
    bad, and serves again once the server answers."""
    page = torch.arange(512, dtype=torch.int64).to(torch.uint8)
    with redis_server_process() as (url, server):
        root = RedisBlobRoot(url, timeouts=DependencyTimeouts(blob_s=0.3, connect_s=0.3))
        store = root.store(NS)
        store.write(KEY, "alice", page)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            failed = within(10, lambda: store.read(KEY, "alice"))
            assert isinstance(failed, BlobStoreUnavailableError), failed
            assert not isinstance(failed, BlobUnavailableError)
            out = torch.zeros((1, 512), dtype=torch.uint8)
            failed = within(10, lambda: store.read_many([KEY], "alice", out))
            assert isinstance(failed, BlobStoreUnavailableError), failed
            assert time.monotonic() - started < 3  # redis-py's own default is 5 s a request
            # Opening the store while the server is frozen asks it nothing (a worker starts);
            # its first call fails as soon.
            opened = within(10, lambda: RedisBlobRoot(
                url, timeouts=DependencyTimeouts(blob_s=0.3, connect_s=0.3)))
            assert isinstance(opened, RedisBlobRoot)
            failed = within(10, lambda: opened.store(NS).read(KEY, "alice"))
            assert isinstance(failed, BlobStoreUnavailableError), failed
            opened.close()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert store.quarantined() == 0
        assert torch.equal(store.read(KEY, "alice"), page)
        server.kill()
        server.wait()
        failed = within(10, lambda: store.read(KEY, "alice"))
        assert isinstance(failed, BlobStoreUnavailableError), failed
        root.close()
