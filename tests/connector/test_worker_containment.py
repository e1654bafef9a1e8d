"""The worker side contains kvci's failures (no engine, no vllm: the real worker, real KV cache
tensors, real blob stores): a load the scheduler could not plan is recomputed, a store copy that
fails is reported finished and never kept, and a blob store that goes away is a miss and a
health signal, never a bad blob."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from worker_support import NUM_BLOCKS, SLOT, kv_cache, page_of

from kvci_plugin.connector.jobs import DiskLoadJob, FailedLoad, StepJobs, StoreJob
from kvci_plugin.connector.worker import KVCIWorker
from kvci_plugin.tiering.blobs.folder import FolderBlobRoot

NS = hashlib.sha256(b"worker-containment").digest()


def worker(blob_root=None, group_layers=None) -> KVCIWorker:
    w = KVCIWorker(num_slots=4, expected_slot_bytes=SLOT // (2 if group_layers else 1),
                   num_blocks=NUM_BLOCKS, rank_namespace=NS, blob_root=blob_root,
                   group_layers=group_layers)
    w.register_kv_caches(kv_cache("cpu"))
    return w


def step(w: KVCIWorker, jobs: StepJobs, finished: set[str] = frozenset()):
    w.bind(jobs)
    w.start_load_kv()
    w.wait_for_save()
    done = w.get_finished(set(finished))
    errors = w.get_block_ids_with_load_errors()
    w.clear()
    return done, errors


def test_a_load_the_scheduler_could_not_plan_is_recomputed() -> None:
    w = worker()
    try:
        (sending, recving), errors = step(w, StepJobs(failed_loads=[
            FailedLoad("sync", [3, 4], False), FailedLoad("async", [7], True)]))
        assert errors == {3, 4, 7}
        assert recving == {"async"}  # vLLM stops waiting for it
        assert w.take_failed_recving() is None  # none failed as a whole
    finally:
        w.shutdown()


def test_with_several_kv_cache_groups_an_async_load_fails_as_a_whole() -> None:
    # vLLM refuses block-level load errors when the model has several KV cache groups.
    w = worker(group_layers=[["layer.0"], ["layer.1"]])
    try:
        (_, recving), errors = step(w, StepJobs(failed_loads=[FailedLoad("async", [7], True)]))
        assert errors == set() and recving == {"async"}
        assert w.take_failed_recving() == {"async"}
    finally:
        w.shutdown()


def test_a_store_copy_that_fails_is_reported_finished_and_never_kept(caplog) -> None:
    w = worker()
    try:
        # A slot past the pool: the copy raises (a kvci bug) and nothing is stored.
        bad = StoreJob(req_id="r", checkpoint_id="c", slots=[99], block_ids=[1])
        (sending, _), _ = step(w, StepJobs(stores=[bad]), finished={"r"})
        assert sending == {"r"}  # vLLM frees the blocks; an unreported id would leak them
        assert w.take_report().failed_stores == ["r"]
        assert w.take_stats().reduce()["faults_ram_internal"] == 1
    finally:
        w.shutdown()


def test_a_blob_store_that_goes_away_is_a_miss_and_a_health_signal(tmp_path: Path) -> None:
    from services import redis_server

    from kvci_plugin.tiering.blobs.redis_store import RedisBlobRoot

    keys = [hashlib.sha256(f"k{i}".encode()).digest()[:16] for i in range(2)]
    with redis_server() as url:
        RedisBlobRoot(url).store(NS).write(keys[0], "alice", page_of(0))
        w = worker(blob_root=RedisBlobRoot(url))
    # The server has stopped: the read fails as the store's failure, not the blob's.
    try:
        job = DiskLoadJob("r", "alice", keys[:1], [5], sync=True)
        _, errors = step(w, StepJobs(disk_loads=[job]))
        assert errors == {5}
        report = w.take_report()
        assert report.bad_pages == []  # the blob is not blamed: every node keeps it
        assert len(report.disk_faults) == 1 and report.disk_faults[0].startswith(
            ("unavailable:", "timeout:"))
        assert (
            sum(v for k, v in w.take_stats().reduce().items() if k.startswith("faults_disk_")) == 1
        )
    finally:
        w.shutdown()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_blob_that_is_not_a_regular_file_is_a_miss_without_a_hang(
    tmp_path: Path, kind: str
) -> None:
    import os

    keys = [hashlib.sha256(b"k").digest()[:16]]
    root = FolderBlobRoot(tmp_path / "disk")
    store = root.store(NS)
    store.write(keys[0], "alice", page_of(0))
    path = store.path_for(keys[0])
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    w = worker(blob_root=FolderBlobRoot(tmp_path / "disk"))
    try:
        _, errors = step(w, StepJobs(disk_loads=[DiskLoadJob("r", "alice", keys, [5], sync=True)]))
        assert errors == {5}
    finally:
        w.shutdown()
