"""No blob I/O while the fleet-wide catalog lock is held: a slow or hung blob store (Redis, NFS)
must not hold up every node's catalog writes. Blobs are measured before a row is written and
deleted after the removal of theirs has committed, sparing a page another write took since
(real PostgreSQL, a real folder, a frozen Redis of the test's own)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import psycopg
import pytest
import torch
from services import redis_server_process
from support.disk_tier import DiskTierForTests
from thread_support import in_background

from kvci_plugin.tiering.blobs.codec import blob_room
from kvci_plugin.tiering.blobs.factory import open_blob_root
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.disk.db import _WRITE_LOCK_ID
from kvci_plugin.tiering.timeouts import DependencyTimeouts

NS = hashlib.sha256(b"lock-io-ns").digest()
SLOT = 512


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"key-{i}".encode()).digest()[:16]


def pages_of(keys: list[bytes]) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(hashlib.shake_128(k).digest(SLOT)),
                                         dtype=torch.uint8) for k in keys])


def lock_is_free(url: str) -> bool:
    """Whether another node could take the catalog's write lock now."""
    with psycopg.connect(url, autocommit=True) as conn:
        free = conn.execute("SELECT pg_try_advisory_lock(%s)", (_WRITE_LOCK_ID,)).fetchone()[0]
        if free:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_WRITE_LOCK_ID,))
    return free


@pytest.mark.parametrize("removal", ["discard", "eviction"])
def test_removed_blobs_go_once_the_catalog_lock_is_released(
        tmp_path: Path, pg_catalog_url: str, removal: str) -> None:
    one_checkpoint = 2 * blob_room(SLOT)
    store = DiskTierForTests(tmp_path / "shared", NS, one_checkpoint, catalog_url=pg_catalog_url)
    a, b = [key_of(0), key_of(1)], [key_of(2), key_of(3)]
    store.persist("a", "alice", a, pages_of(a), "agent", "{}", "{}", None)
    blobs = open_blob_root(None, tmp_path / "shared").store(store.namespace)
    # Told after the blobs are deleted: (keys, whether another node could write the catalog
    # then, whether any blob was still there).
    seen: list[tuple[list[bytes], bool, bool]] = []
    store.on_pages_removed = lambda keys: seen.append(
        (list(keys), lock_is_free(pg_catalog_url), any(blobs.exists(k) for k in keys)))
    if removal == "discard":
        store.discard(a[:1])
        assert seen == [(a[:1], True, False)]
    else:
        store.persist("b", "alice", b, pages_of(b), "agent", "{}", "{}", None)
        [(evicted, free, left)] = seen  # "a", then as many of its pages as the bound needs
        assert evicted and set(evicted) <= set(a) and (free, left) == (True, False)
        assert store.longest_prefix(b, "alice") == 2
    store.close()


@pytest.mark.parametrize("call", ["release", "record_written"])
def test_a_hung_blob_store_holds_no_catalog_lock(pg_catalog_url: str, call: str) -> None:
    """While a write's blobs are measured (record_written: STRLEN) or an abandoned write's are
    deleted (release: DEL) on a Redis server that does not answer, other nodes still write the
    catalog."""
    keys = [key_of(0), key_of(1)]
    timeouts = DependencyTimeouts(blob_s=1.5, connect_s=1.0)
    with redis_server_process() as (url, server):
        store = DiskTierForTests(None, NS, 1 << 30, catalog_url=pg_catalog_url, blob_url=url,
                                  timeouts=timeouts)
        store.reserve("w", keys, "alice")
        blobs = open_blob_root(url, None, timeouts=timeouts)
        blobs.store(store.namespace).write_many(keys, "alice", pages_of(keys))
        os.kill(server.pid, signal.SIGSTOP)
        try:
            if call == "release":
                thread, _ = in_background(lambda: store.release("w", keys))
            else:
                thread, _ = in_background(lambda: store.record_written(
                    "w", "alice", keys, SLOT, "agent", "{}", "{}", None))
            time.sleep(0.5)  # the call is waiting on Redis now
            assert thread.is_alive()
            assert lock_is_free(pg_catalog_url)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        thread.join(10)
        assert not thread.is_alive()
        blobs.close()
        store.close()


def test_a_page_leased_again_before_its_blob_is_deleted_keeps_its_blob(
        tmp_path: Path, pg_catalog_url: str) -> None:
    """Between the commit that ends a write's lease and the deletion of its blobs, another
    node leases the page to write it: the deletion spares it. (The check that spares it is
    held up here until the other lease is taken, by a lock on the pages table.)"""
    key = key_of(0)
    store = DiskTierForTests(tmp_path / "shared", NS, 1 << 30, catalog_url=pg_catalog_url,
                              timeouts=DependencyTimeouts(lock_s=10, statement_s=10))
    store.reserve("w1", [key], "alice")
    blobs = open_blob_root(None, tmp_path / "shared").store(store.namespace)
    blobs.write(key, "alice", pages_of([key])[0])
    other_node = CheckpointCatalog(url=pg_catalog_url)
    with psycopg.connect(pg_catalog_url, autocommit=True) as blocker:
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE pages IN ACCESS EXCLUSIVE MODE")
        thread, outcome = in_background(lambda: store.release("w1", [key]))
        deadline = time.monotonic() + 5
        while not blocker.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND relation = 'pages'::regclass").fetchone()[0]:
            assert time.monotonic() < deadline, "release never asked about the page"
            time.sleep(0.01)
        # The lease ended (committed) and the deletion has not checked yet: another node leases.
        other_node.lease(store.namespace, [key], "w2", time.time() + 60, tenant="alice")
        blocker.execute("COMMIT")
    thread.join(10)
    assert outcome == [None]
    assert blobs.exists(key)
    other_node.close()
    store.close()
