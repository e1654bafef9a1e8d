"""The KV cache released and restored around the worker (no engine: the real worker, real KV cache
tensors; on a GPU too, ``KV_DEVICES``): vLLM 0.33 does it around a sleep, 0.34 also around a
layer-wise weight update that borrows the extensible KV cache's memory, whose pages come back
new (zeroed) at the same addresses.

What must hold: the page views, the RAM pool and the staging buffer survive (the same addresses,
nothing re-registered); nothing from before the release comes back — a disk load in flight is
reported failed, and loads and persists of every generation the worker had seen are refused until
the scheduler's jobs come in a newer one, which the worker's report asks for (the scheduler's
half: tests/connector/test_connector_hooks_034.py); stores still run and are reported, so vLLM
frees their blocks.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from worker_support import KV_DEVICES, NUM_BLOCKS, SLOT, block_bytes, kv_cache, page_of, write_block

from kvci_plugin.connector.jobs import DiskLoadJob, LoadJob, PersistJob, StepJobs, StoreJob
from kvci_plugin.connector.worker import KVCIWorker
from kvci_plugin.tiering.blobs.folder import FolderBlobRoot

NS = hashlib.sha256(b"worker-release").digest()
ZERO = torch.zeros(SLOT, dtype=torch.uint8)


@pytest.fixture(params=KV_DEVICES)
def setup(request: pytest.FixtureRequest, tmp_path: Path):
    kv = kv_cache(request.param)
    for block in range(NUM_BLOCKS):
        write_block(kv, block, page_of(block))
    worker = KVCIWorker(num_slots=6, expected_slot_bytes=SLOT, num_blocks=NUM_BLOCKS,
                        rank_namespace=NS, blob_root=FolderBlobRoot(tmp_path / "disk"))
    worker.register_kv_caches(kv)
    yield worker, kv, FolderBlobRoot(tmp_path / "disk")
    worker.shutdown()


def step(worker: KVCIWorker, jobs: StepJobs, finished: set[str] = frozenset()) -> set[str]:
    worker.bind(jobs)
    worker.start_load_kv()
    worker.wait_for_save()
    sending, _ = worker.get_finished(set(finished))
    worker.clear()
    return sending or set()


def stored(worker: KVCIWorker, req_id: str, slots: list[int], blocks: list[int],
           generation: int = 0) -> None:
    seen = step(worker, StepJobs(stores=[StoreJob(req_id, "c-" + req_id, slots, blocks)],
                                 generation=generation), {req_id})
    deadline = time.monotonic() + 30
    while req_id not in seen and time.monotonic() < deadline:
        seen |= step(worker, StepJobs(generation=generation))
    assert req_id in seen


def released_and_restored(worker: KVCIWorker, kv: dict[str, torch.Tensor]) -> None:
    """What vLLM does around a weight update: unregister, the cache's pages given back and
    committed again (new, zeroed: the same addresses), the weights changed, restore."""
    worker.unregister_kv_caches()
    for tensor in kv.values():
        tensor.zero_()  # recommit: fresh pages at the addresses the views name
    worker.restore_kv_caches()


def view_addresses(worker: KVCIWorker) -> list[int]:
    return [v.data_ptr() for views in worker._views for v in views]


def test_a_weight_update_without_a_reset_loads_nothing_from_before(setup) -> None:
    worker, kv, blobs = setup
    stored(worker, "w", [0, 1, 2], [3, 4, 5])  # generation 0's KV, computed with the old weights
    views, pool = view_addresses(worker), worker._pool.pages.data_ptr()
    staging = worker._staging.data_ptr()
    released_and_restored(worker, kv)
    # The views, the pool and the staging buffer are the ones registered (nothing to redo).
    assert view_addresses(worker) == views and worker._pool.pages.data_ptr() == pool
    assert worker._staging.data_ptr() == staging
    assert view_addresses(worker)[0] == next(iter(kv.values())).data_ptr()
    report = worker.take_report()
    assert report is not None and report.fence_generation == 0  # the scheduler: reset

    # The scheduler has not reset yet (vLLM's reset_connector=False): its jobs are generation 0's.
    key = hashlib.sha256(b"old").digest()[:16]
    assert step(worker, StepJobs(loads=[LoadJob("r", [0, 1, 2], [7, 8, 9])],
                                 persists=[PersistJob("p", "alice", [key], [0])])) == set()
    assert all(torch.equal(block_bytes(kv, b), ZERO) for b in (7, 8, 9))  # nothing loaded
    assert worker.get_block_ids_with_load_errors() == {7, 8, 9}  # vLLM recomputes them
    report = worker.take_report()
    assert report.failed_loads == ["r"] and report.fence_generation == 0  # asked again
    assert "fenced" in report.persist_errors["p"][0] and not blobs.store(NS).exists(key)
    # A store still runs (KV computed after the restore) and is reported: vLLM frees its blocks.
    write_block(kv, 10, page_of(100))
    stored(worker, "s", [3], [10])

    # The scheduler's reset reaches the worker: its jobs are generation 1's, and copy again.
    write_block(kv, 11, page_of(111))
    stored(worker, "new", [4], [11], generation=1)
    step(worker, StepJobs(loads=[LoadJob("r2", [4], [12])], generation=1))
    assert torch.equal(block_bytes(kv, 12), page_of(111))
    assert worker.get_block_ids_with_load_errors() == set()
    report = worker.take_report()
    assert report is None or report.fence_generation is None  # the fence is behind


def test_a_release_after_the_schedulers_reset_fences_nothing_more(setup) -> None:
    worker, kv, _ = setup
    stored(worker, "w", [0], [3])
    # vLLM reset the connector before the sleep (reset_connector=True): the scheduler is at
    # generation 1, which no step has told the worker yet.
    released_and_restored(worker, kv)
    assert worker.take_report().fence_generation == 0
    write_block(kv, 5, page_of(55))
    stored(worker, "new", [1], [5], generation=1)
    step(worker, StepJobs(loads=[LoadJob("r", [1], [6])], generation=1))
    assert torch.equal(block_bytes(kv, 6), page_of(55))
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_release_before_any_step_fences_the_first_generation_told(setup) -> None:
    worker, kv, _ = setup
    released_and_restored(worker, kv)  # the scheduler's generation is not known here yet
    assert worker.take_report() is None
    write_block(kv, 2, page_of(22))
    worker._pool.write(0, page_of(22))  # a page the tier held from before (e.g. a restart's)
    step(worker, StepJobs(loads=[LoadJob("r", [0], [9])], generation=5))
    assert torch.equal(block_bytes(kv, 9), ZERO)
    assert worker.get_block_ids_with_load_errors() == {9}
    assert worker.take_report().fence_generation == 5
    step(worker, StepJobs(loads=[LoadJob("r2", [0], [9])], generation=6))
    assert torch.equal(block_bytes(kv, 9), page_of(22))


def test_a_disk_load_in_flight_at_the_release_is_recomputed(setup) -> None:
    worker, kv, blobs = setup
    keys = [hashlib.sha256(f"k{i}".encode()).digest()[:16] for i in range(3)]
    for i, key in enumerate(keys):
        blobs.store(NS).write(key, "alice", page_of(i))
    worker.bind(StepJobs(disk_loads=[DiskLoadJob("d", "alice", keys, [7, 8, 9])], forward=False))
    worker.start_load_kv()
    worker.clear()
    released_and_restored(worker, kv)  # the read ran to its end; its blocks lost their memory
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        worker.bind(StepJobs(forward=False, generation=1))  # even after the scheduler's reset
        worker.start_load_kv()
        _, recving = worker.get_finished(set())
        worker.clear()
        if recving:
            break
    assert recving == {"d"}
    assert worker.get_block_ids_with_load_errors() == {7, 8, 9}


def test_sleep_twice_fences_the_newest_generation_seen(setup) -> None:
    worker, kv, _ = setup
    step(worker, StepJobs(generation=2))
    released_and_restored(worker, kv)
    step(worker, StepJobs(generation=3))
    released_and_restored(worker, kv)
    assert worker.take_report().fence_generation == 3
    worker._pool.write(0, page_of(1))
    step(worker, StepJobs(loads=[LoadJob("r", [0], [4])], generation=3))
    assert worker.get_block_ids_with_load_errors() == {4}


@pytest.mark.parametrize("device", KV_DEVICES)
def test_views_over_the_committed_blocks_of_a_reservation(device: str, tmp_path: Path) -> None:
    """vLLM 0.34's extensible KV cache hands the connector views over the committed blocks of a
    larger reserved range (created after warm-up, at their final size): kvci's page views are
    views of those, so its copies land in the reservation, and a release and recommit of the
    pages (same addresses, new zeroed memory) needs nothing registered again."""
    reserved = {name: torch.zeros((4 * NUM_BLOCKS, *t.shape[1:]), device=device)
                for name, t in kv_cache(device).items()}
    committed = {name: t[:NUM_BLOCKS] for name, t in reserved.items()}
    worker = KVCIWorker(num_slots=4, expected_slot_bytes=SLOT, num_blocks=NUM_BLOCKS,
                        rank_namespace=NS, blob_root=None)
    try:
        worker.register_kv_caches(committed)
        write_block(committed, 3, page_of(3))
        stored(worker, "w", [0], [3])
        released_and_restored(worker, committed)
        assert torch.equal(block_bytes(committed, 3), ZERO)  # the recommitted pages are new
        step(worker, StepJobs(loads=[LoadJob("r", [0], [5])]))  # generation 0's: refused
        assert worker.get_block_ids_with_load_errors() == {5}
        assert torch.equal(block_bytes(committed, 5), ZERO)
        write_block(committed, 7, page_of(77))  # after the scheduler's reset: generation 1
        stored(worker, "w3", [2], [7], generation=1)
        step(worker, StepJobs(loads=[LoadJob("r2", [2], [8])], generation=1))
        assert torch.equal(block_bytes(committed, 8), page_of(77))
        assert committed["layer.0"][8].data_ptr() == reserved["layer.0"][8].data_ptr()
        assert not any(t[NUM_BLOCKS:].any() for t in reserved.values())  # past the commit
    finally:
        worker.shutdown()
