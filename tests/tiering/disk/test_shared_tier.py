"""The disk tier shared by several nodes: a PostgreSQL catalog and a shared folder or Redis.

Nodes are separate processes (or separate stores) on one real PostgreSQL server and one real
blob location: what one persists, another serves after verifying it; tenancy holds on every
node; concurrent writers of overlapping pages end consistent with nothing lost; a writer killed
mid-way leaves nothing torn that anyone will load; eviction and reconciliation on one node never
delete a blob another node's write holds.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from shared_support import (
    NS,
    Location,
    checkpoint_keys,
    key_of,
    open_node,
    page_of,
    persist_many,
)

from kvci_plugin.tiering.blobs.errors import BlobMissingError
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.types import CheckpointNotFoundError, TenantMismatchError


def persist(store, checkpoint_id: str, keys: list[bytes], tenant: str = "alice"):
    return store.persist(checkpoint_id, tenant, keys, torch.stack([page_of(k) for k in keys]),
                         "agent", "{}", "{}", None)


def assert_consistent(location: Location, catalog_url: str) -> dict[str, list[bytes]]:
    """Every record loads whole and verifies; every blob has a row. Returns id -> page keys."""
    node = open_node(location.kind, location.address, catalog_url)
    records = {r.checkpoint_id: list(r.page_keys) for r in node.list()}
    for checkpoint_id, keys in records.items():
        loaded = node.load(checkpoint_id, "alice")
        assert torch.equal(loaded, torch.stack([page_of(k) for k in keys])), checkpoint_id
    rows = {page.key.hex() for page, _ in CheckpointCatalog(url=catalog_url).pages()}
    blobs = {b.key_hex for b in location.open().listing()}
    assert blobs == rows
    node.close()
    return records


def test_a_checkpoint_persisted_on_one_node_is_served_verified_on_another(
    location: Location, pg_catalog_url: str
) -> None:
    a = open_node(location.kind, location.address, pg_catalog_url)
    b = open_node(location.kind, location.address, pg_catalog_url)
    keys = [key_of(i) for i in range(3)]
    persist(a, "ctx", keys)
    assert b.longest_prefix(keys, "alice") == 3
    assert torch.equal(b.load("ctx", "alice"), torch.stack([page_of(k) for k in keys]))
    # Tenancy holds on the node that did not write it, although it sees the row.
    assert b.explain("ctx") is not None
    with pytest.raises(TenantMismatchError):
        b.load("ctx", "mallory")
    assert b.longest_prefix(keys, "mallory") == 0
    # Bytes are verified on the reading node: a flipped byte is a miss there, and the bad page
    # is forgotten for every node.
    raw = bytearray(location.raw(NS, keys[1]))
    raw[-1] ^= 0x40
    location.plant(NS, keys[1], bytes(raw))
    assert b.load_prefix(keys, "alice").shape[0] == 1
    assert a.longest_prefix(keys, "alice") == 1
    with pytest.raises(CheckpointNotFoundError):
        a.load("ctx", "alice")


def test_eviction_on_one_node_spares_a_page_another_node_is_writing(
    location: Location, pg_catalog_url: str
) -> None:
    a = open_node(location.kind, location.address, pg_catalog_url)
    persist(a, "old", [key_of(0), key_of(1)])
    page_bytes = a.stats().bytes_used // 2
    # Node B starts a write that reuses page 0 (leased, blob kept as it is) ...
    b = open_node(location.kind, location.address, pg_catalog_url, disk_bytes=3 * page_bytes)
    b.reserve("new", [key_of(0), key_of(2)], "alice")
    # ... while node A's checkpoint goes and node A evicts everything it can.
    CheckpointCatalog(url=pg_catalog_url).remove("old")
    tight = open_node(location.kind, location.address, pg_catalog_url, disk_bytes=1)
    tight.reconcile()
    store = location.open().store(NS)
    assert store.exists(key_of(0)), "a leased blob was deleted"
    # B finishes its write and records it: both blobs are there and verify.
    store.write(key_of(2), "alice", page_of(key_of(2)))
    b.record_written("new", "alice", [key_of(0), key_of(2)], 512, "agent", "{}", "{}", None)
    assert torch.equal(b.load("new", "alice")[0], page_of(key_of(0)))


def test_reconcile_keeps_young_and_leased_orphans_and_removes_dead_ones(
    location: Location, pg_catalog_url: str
) -> None:
    store = location.open().store(NS)
    node = open_node(location.kind, location.address, pg_catalog_url, lease_s=1.0)
    store.write(key_of(7), "alice", page_of(key_of(7)))  # a write under way, no lease yet
    node.reserve("w", [key_of(8)], "alice")
    store.write(key_of(8), "alice", page_of(key_of(8)))
    assert node.reconcile().orphan_blobs == 0
    assert store.exists(key_of(7)) and store.exists(key_of(8))
    time.sleep(1.2)
    report = node.reconcile()  # both now older than a lease, and the lease has expired
    assert report.orphan_blobs == 2
    assert not store.exists(key_of(7)) and not store.exists(key_of(8))


def test_concurrent_writers_end_consistent_with_nothing_lost(
    location: Location, pg_catalog_url: str, tmp_path: Path
) -> None:
    ctx = multiprocessing.get_context("spawn")
    report = tmp_path / "durable.txt"
    writers = [
        ctx.Process(
            target=persist_many,
            args=(location.kind, location.address, pg_catalog_url, node, 12, str(report), 600.0),
        )
        for node in range(3)
    ]
    for p in writers:
        p.start()
    for p in writers:
        p.join(300)
        assert p.exitcode == 0
    durable = report.read_text().split()
    assert len(durable) == 36
    records = assert_consistent(location, pg_catalog_url)
    assert sorted(records) == sorted(durable)
    for checkpoint_id in durable:
        node, i = (int(x) for x in checkpoint_id[1:].split("-"))
        assert records[checkpoint_id] == checkpoint_keys(node, i)
    # The four shared pages are stored once.
    assert CheckpointCatalog(url=pg_catalog_url).stats().pages == 4 + 3 * 12 * 2


def test_a_writer_killed_mid_way_leaves_nothing_torn_loadable(
    location: Location, pg_catalog_url: str, tmp_path: Path
) -> None:
    ctx = multiprocessing.get_context("spawn")
    report = tmp_path / "durable.txt"
    lease_s = 2.0
    victim = ctx.Process(
        target=persist_many,
        args=(location.kind, location.address, pg_catalog_url, 0, 400, str(report), lease_s),
    )
    steady = ctx.Process(
        target=persist_many,
        args=(location.kind, location.address, pg_catalog_url, 1, 10, str(report), lease_s),
    )
    victim.start()
    steady.start()
    deadline = time.monotonic() + 120
    while (
        not report.exists() or report.read_text().count("n0-") < 3
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    steady.join(300)
    assert steady.exitcode == 0
    durable = report.read_text().split()
    assert any(d.startswith("n0-") for d in durable)
    # The dead writer's lease expires; a node's start-up then removes what it left.
    time.sleep(lease_s + 0.5)
    open_node(location.kind, location.address, pg_catalog_url, lease_s=lease_s).close()
    records = assert_consistent(location, pg_catalog_url)
    assert set(durable) <= set(records)
    with pytest.raises(BlobMissingError):
        location.open().store(NS).read(key_of(999_999), "alice")
