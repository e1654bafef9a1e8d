"""Fault containment on the one-node disk tier: a SQLite catalog and blob files in a folder, the
folder a small tmpfs of this module's own.

- The filesystem fills up: persists fail cleanly (counted, never raised into vLLM, never
  reported durable), every request completes with the output of recomputing, and once space is
  freed persists land and persisted prompts are served from disk again, by the same engine.
- A blob file replaced by a FIFO, a directory or a huge sparse file: the request completes (the
  KV recomputed) within a bound, with the baseline's output, the page is forgotten (one
  recompute, not one at every lookup) and the engine serves on.
- A catalog row whose blob is gone, and blobs no row names: the same.

The module's engine persists one prompt per test at start and floods its small LRU RAM tier, so
those prompts are held on disk only. Each test damages its own prompt's blobs and restores what
it changed to the filesystem in a `finally` (the tmpfs is unmounted at the end).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from durable_support import blob_paths, catalog_rows, checkpoint_blob_keys, session_token
from fault_support import (
    FAULT_KINDS,
    ModuleEngine,
    assert_alive,
    assert_baseline,
    base_fixture,
    counter,
    durable_extra,
    evict_to_disk,
    faults,
    faults_since,
    fill,
    no_hang_fixture,
    persist,
    persisted_to_disk,
    send,
    step_until,
    tmpfs,
    unblock_fifo,
    wait_for_disk_hit,
    wait_healthy,
)

pytestmark = pytest.mark.engine

KEPT = {"full": "kept4", "fifo": "kept5", "directory": "kept6", "sparse-1GiB": "kept7",
        "sparse-64GiB": "kept8", "blob_gone": "kept9", "row_gone": "kept10"}
READ_BOUND_S = 30.0  # a request whose blob is not a blob returns within this (no hang)


@dataclass
class Disk:
    engine: ModuleEngine
    root: Path
    disk: Path
    ids: dict[str, str]  # prompt -> checkpoint id


base = base_fixture()
no_hang = no_hang_fixture(240)


@pytest.fixture(scope="module")
def disk_tier(tiny_model, base, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-disk")
    with (tmpfs(root / "disk", "16M") as disk,
          ModuleEngine(tiny_model, durable_extra(root, disk_root=str(disk)), base) as engine):
        ids = persisted_to_disk(engine.llm, root, list(KEPT.values()), base,
                                lambda: set(catalog_rows(disk)))
        yield Disk(engine, root, disk, ids)


def _blob(d: Disk, name: str, page: int = 0) -> Path:
    """The blob file of page `page` of the persisted prompt `name`."""
    key = checkpoint_blob_keys(d.disk, d.ids[name])[page]
    (path,) = [p for p in blob_paths(d.disk) if p.stem == key]
    return path


def _forgotten(llm, name: str, base) -> None:
    """The bad blob cost one recompute: once the tier is healthy, the prompt is a plain miss
    (the page was forgotten with its checkpoint, not offered again at every lookup)."""
    wait_healthy(llm)
    out = send(llm, name, READ_BOUND_S, tenant="acme")
    assert_baseline(out, name, base)
    assert out.num_cached_tokens == 0, (name, out.kv_transfer_params["kvci"].get("hit_tier"))


def test_a_full_filesystem_fails_persists_cleanly_and_heals(disk_tier, base):
    d = disk_tier
    llm = d.engine.alive()
    before, failures = faults(llm), counter(llm, "vllm:kvci_persist_failures")
    token = session_token(d.root)
    filler = d.disk / "filler.bin"
    try:
        fill(filler)
        assert shutil.disk_usage(d.disk).free < 64 * 1024
        reply = send(llm, "fresh8", tenant="acme", session_token=token, persist=True,
                     source_ids=["doc:handbook"])
        assert_baseline(reply, "fresh8", base)
        refused = reply.kv_transfer_params["kvci"]["checkpoint_id"]
        for name in ("fresh9", KEPT["full"], "fresh9"):  # the write's steps; a lookup; a miss
            assert_baseline(send(llm, name, tenant="acme"), name, base)
        assert_alive(llm, base)
        reported = (sum(faults_since(llm, before).get(("disk", k), 0) for k in FAULT_KINDS)
                    + counter(llm, "vllm:kvci_persist_failures") - failures)
        assert reported >= 1, "a persist into a full filesystem failed silently"
        assert refused not in catalog_rows(d.disk)  # never recorded durable
    finally:
        filler.unlink(missing_ok=True)
    # Space is back: persisted prompts hit again, and a new persist lands.
    wait_for_disk_hit(llm, KEPT["full"], base)
    again = send(llm, "fresh10", tenant="acme", session_token=token, persist=True,
                 source_ids=["doc:handbook"])
    assert_baseline(again, "fresh10", base)
    cid = again.kv_transfer_params["kvci"]["checkpoint_id"]
    step_until(llm, lambda: cid in catalog_rows(d.disk), "a persist after space was freed", 30.0)


def test_a_blob_replaced_by_a_fifo_is_recomputed_without_a_hang(disk_tier, base):
    d = disk_tier
    llm = d.engine.alive()
    path = _blob(d, KEPT["fifo"])
    path.unlink()
    os.mkfifo(path, 0o600)  # a read that opens it blocks until a writer comes: none will
    try:
        out = send(llm, KEPT["fifo"], READ_BOUND_S, tenant="acme")
        assert_baseline(out, KEPT["fifo"], base)
        _forgotten(llm, KEPT["fifo"], base)
    finally:
        unblock_fifo(path)  # a hung reader, if any, reads end of file
        if path.exists() or path.is_fifo():
            path.unlink()
    assert_alive(llm, base)


def test_a_blob_replaced_by_a_directory_is_recomputed(disk_tier, base):
    d = disk_tier
    llm = d.engine.alive()
    path = _blob(d, KEPT["directory"])
    path.unlink()
    path.mkdir()
    try:
        out = send(llm, KEPT["directory"], READ_BOUND_S, tenant="acme")
        assert_baseline(out, KEPT["directory"], base)
        _forgotten(llm, KEPT["directory"], base)
    finally:
        if path.is_dir():
            shutil.rmtree(path)
    assert_alive(llm, base)


@pytest.mark.parametrize("size", ["sparse-1GiB", "sparse-64GiB"])
def test_a_blob_replaced_by_a_huge_sparse_file_is_recomputed(disk_tier, base, size):
    d = disk_tier
    llm = d.engine.alive()
    name = KEPT[size]
    path = _blob(d, name)
    path.unlink()
    with open(path, "wb") as f:  # takes no space on the tmpfs: a read returns zeros
        f.truncate((1 << 30) * (1 if size == "sparse-1GiB" else 64))
    try:
        started = time.monotonic()
        out = send(llm, name, READ_BOUND_S, tenant="acme")
        assert_baseline(out, name, base)
        print(f"{size}: recomputed in {time.monotonic() - started:.1f} s")
        _forgotten(llm, name, base)
    finally:
        path.unlink(missing_ok=True)
    assert_alive(llm, base)


def test_a_catalog_row_whose_blobs_are_gone_is_recomputed(disk_tier, base):
    d = disk_tier
    llm = d.engine.alive()
    name = KEPT["blob_gone"]
    for page in range(5):
        _blob(d, name, page).unlink()
    out = send(llm, name, tenant="acme")
    assert_baseline(out, name, base)
    again = send(llm, name, tenant="acme")  # the row went with its blobs: a plain miss
    assert_baseline(again, name, base)
    assert again.num_cached_tokens == 0
    assert d.ids[name] not in catalog_rows(d.disk)
    assert_alive(llm, base)


def _drop_rows(disk: Path, checkpoint_id: str) -> list[str]:
    """Delete a checkpoint's catalog rows behind the engine's back, leaving its blobs; their
    keys."""
    keys = checkpoint_blob_keys(disk, checkpoint_id)
    conn = sqlite3.connect(disk / "catalog.sqlite3", timeout=10, isolation_level=None)
    try:
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,))
        conn.executemany("DELETE FROM pages WHERE key = ? AND NOT EXISTS "
                         "(SELECT 1 FROM checkpoint_pages c WHERE c.key = pages.key)",
                         [(k,) for k in keys])
        conn.execute("COMMIT")
    finally:
        conn.close()
    return keys


def test_blobs_no_catalog_row_names_are_ignored_then_reused(disk_tier, base):
    d = disk_tier
    llm = d.engine.alive()
    name = KEPT["row_gone"]
    keys = _drop_rows(d.disk, d.ids[name])
    blobs = {p.stem: p for p in blob_paths(d.disk)}
    assert set(keys) <= set(blobs)  # its blobs are still there, named by no row
    # More orphans: a copy of a real blob under another page's name, and junk under a third.
    shard = blobs[keys[0]].parent.parent
    (shard / "ab").mkdir(exist_ok=True)
    shutil.copy(blobs[keys[0]], shard / "ab" / ("ab" + "0" * 30 + ".safetensors"))
    (shard / "ab" / ("ab" + "1" * 30 + ".safetensors")).write_bytes(os.urandom(1000))
    out = send(llm, name, tenant="acme")
    assert_baseline(out, name, base)
    assert out.num_cached_tokens == 0  # no row: not a hit
    # Persisted again, its write finds the orphaned blobs; a later lookup hits them from disk.
    (cid,) = persist(llm, d.root, [name]).values()
    step_until(llm, lambda: cid in catalog_rows(d.disk), "the persist over orphaned blobs")
    d.ids[name] = cid
    evict_to_disk(llm, d.root, [name], base)
    assert_alive(llm, base)
