"""The worker's disk load on real blob files and real KV cache tensors (no engine): verified
pages land in their blocks a staging buffer at a time, and the first bad page ends the prefix.

Imports no vllm: run.sh runs it on the GPU machine too, with the KV cache there (``device``)."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch
from worker_support import KV_DEVICES, NUM_BLOCKS, SLOT, block_bytes, kv_cache, page_of

import kvci_plugin.connector.worker as worker_module
from kvci_plugin.connector.jobs import DiskLoadJob, PersistJob, StepJobs
from kvci_plugin.connector.worker import KVCIWorker
from kvci_plugin.tiering.blobs.folder import FolderBlobRoot
from kvci_plugin.tiering.keys import generation_namespace

NS = hashlib.sha256(b"worker-disk-load").digest()
PAGES = 8


@pytest.fixture(params=KV_DEVICES)
def setup(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Three pages a part: the 8-page prefix is read and scattered in three parts.
    monkeypatch.setattr(worker_module, "STAGING_BYTES", 3 * SLOT)
    keys = [hashlib.sha256(f"key-{i}".encode()).digest()[:16] for i in range(PAGES)]
    blobs = FolderBlobRoot(tmp_path / "disk").store(NS)
    for i, key in enumerate(keys):
        blobs.write(key, "alice", page_of(i))
    kv = kv_cache(request.param)
    worker = KVCIWorker(num_slots=4, expected_slot_bytes=SLOT, num_blocks=NUM_BLOCKS,
                        rank_namespace=NS, blob_root=FolderBlobRoot(tmp_path / "disk"))
    worker.register_kv_caches(kv)
    yield worker, kv, keys, blobs
    worker.shutdown()


def start_load(worker: KVCIWorker, job: DiskLoadJob, generation: int = 0) -> None:
    """Start the load in a step that computes nothing."""
    worker.bind(StepJobs(disk_loads=[job], forward=False, generation=generation))
    worker.start_load_kv()
    worker.clear()


def run_load(worker: KVCIWorker, job: DiskLoadJob, generation: int = 0) -> set[int]:
    """Start the load and step until it is reported; the block ids that failed."""
    start_load(worker, job, generation)
    return _step_until_reported(worker, job.req_id, generation)


def test_the_staging_buffer_is_faulted_in_when_the_caches_register(setup) -> None:
    # A disk tier's first hit would otherwise fault the whole buffer in while it reads.
    worker, _, _, _ = setup
    assert worker._staging is not None and worker._staging.shape == (3, SLOT)


def test_a_prefix_longer_than_the_staging_buffer_lands_whole(setup) -> None:
    worker, kv, keys, _ = setup
    blocks = [11, 2, 7, 0, 15, 4, 9, 13]  # scattered anywhere in the cache
    assert run_load(worker, DiskLoadJob("r1", "alice", keys, blocks)) == set()
    for i, block in enumerate(blocks):
        assert torch.equal(block_bytes(kv, block), page_of(i)), i
    untouched = set(range(NUM_BLOCKS)) - set(blocks)
    assert all(not block_bytes(kv, b).any() for b in untouched)
    report = worker.take_report()  # the load's bytes and time, for the scheduler's LoadOrRecompute
    assert report.bad_pages == [] and [n for n, _ in report.disk_loads] == [PAGES * SLOT]
    assert report.disk_loads[0][1] > 0
    stats = worker.take_stats()
    assert stats.reduce()["loaded_bytes_disk"] == PAGES * SLOT
    # Where the load's time went: its read-and-verify and its scatter parts, within its whole.
    (whole,), (read,), (scatter,) = (stats.data["latency"][name] for name in
                                     ("load_disk", "phase_disk_read", "phase_disk_scatter"))
    assert read > 0 and scatter > 0 and read + scatter <= whole


def test_a_bad_page_in_a_later_part_ends_the_prefix_there(setup) -> None:
    worker, kv, keys, blobs = setup
    path = blobs.path_for(keys[4])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    blocks = list(range(8, 16))
    assert run_load(worker, DiskLoadJob("r2", "alice", keys, blocks)) == set(blocks[4:])
    for i in range(4):
        assert torch.equal(block_bytes(kv, blocks[i]), page_of(i))
    assert all(not block_bytes(kv, b).any() for b in blocks[4:])  # never a corrupt byte
    assert worker.take_report().bad_pages == [keys[4]]
    assert blobs.quarantined() == 1


def test_another_tenant_loads_nothing(setup) -> None:
    worker, kv, keys, _ = setup
    blocks = list(range(PAGES))
    assert run_load(worker, DiskLoadJob("r3", "mallory", keys, blocks)) == set(blocks)
    assert all(not block_bytes(kv, b).any() for b in blocks)
    report = worker.take_report()  # intact blobs of another tenant are not "bad"
    assert report is not None and report.bad_pages == [] and report.failed_loads == ["r3"]


def test_a_sync_load_is_in_place_when_start_load_kv_returns_and_never_reported_as_received(
    setup,
) -> None:
    worker, kv, keys, blobs = setup
    path = blobs.path_for(keys[6])
    path.write_bytes(path.read_bytes()[:-1])  # truncated: the prefix ends at page 6
    blocks = [3, 14, 1, 8, 12, 5, 10, 6]
    worker.bind(StepJobs(disk_loads=[DiskLoadJob("r5", "alice", keys, blocks, sync=True)],
                         forward=True))
    worker.start_load_kv()
    # Before the forward: every verified page is in its block, the rest is this step's error.
    for i in range(6):
        assert torch.equal(block_bytes(kv, blocks[i]), page_of(i)), i
    assert worker.get_block_ids_with_load_errors() == set(blocks[6:])
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None)  # vLLM waits for no async load of it
    worker.clear()
    report = worker.take_report()
    assert report.bad_pages == [keys[6]] and [n for n, _ in report.disk_loads] == [6 * SLOT]


def test_on_the_cpu_a_sync_load_is_copied_in_as_the_forward_reaches_each_layer(
    setup, monkeypatch
) -> None:
    worker, kv, keys, _ = setup
    if kv["layer.0"].device.type != "cpu":
        pytest.skip("a CUDA disk load is scattered on its stream before the forward")
    monkeypatch.setattr(worker_module, "STAGING_BYTES", PAGES * SLOT)  # the prefix fits it
    worker._staging = None  # made at registration with the fixture's size: made again

    def sync_step(blocks: list[int], waits: list[str]) -> dict[str, torch.Tensor]:
        """One forward's step reading ``keys`` into ``blocks``: layer 0's bytes there after
        ``start_load_kv`` and after each wait."""
        for t in kv.values():
            t[blocks] = 0
        worker.bind(StepJobs(disk_loads=[DiskLoadJob("s", "alice", keys, blocks, sync=True)]))
        worker.start_load_kv()
        seen = {"start": torch.cat([kv["layer.0"][b].view(torch.uint8).flatten() for b in blocks])}
        for name in waits:
            worker.wait_for_layer_load(name)
            seen[name] = torch.cat([kv["layer.0"][b].view(torch.uint8).flatten() for b in blocks])
        worker.wait_for_save()
        worker.clear()
        for i, block in enumerate(blocks):  # whole once the step ends
            assert torch.equal(block_bytes(kv, block), page_of(i)), i
        return seen

    half = SLOT // 2  # each of the two layers holds half a slot
    want = torch.cat([page_of(i)[:half] for i in range(PAGES)])
    first = sync_step(list(range(PAGES)), ["layer.0"])  # no layer known to wait: all in at once
    assert torch.equal(first["start"], want)
    later = sync_step(list(range(8, 16)), ["layer.0"])
    assert not later["start"].any() and torch.equal(later["layer.0"], want)
    stats = worker.take_stats()  # disk loads, counted once each and never as RAM
    totals = stats.reduce()
    assert totals["loaded_bytes_disk"] == 2 * PAGES * SLOT and not totals.get("loaded_bytes_ram")
    # Their copies ran within the forward: no scatter phase of its own is reported for them.
    assert len(stats.data["latency"]["phase_disk_read"]) == 2
    assert "phase_disk_scatter" not in stats.data["latency"]
    # A prefix longer than the staging buffer is scattered part by part before the forward.
    worker._staging = None
    monkeypatch.setattr(worker_module, "STAGING_BYTES", 3 * SLOT)
    assert torch.equal(sync_step(list(range(PAGES)), ["layer.0"])["start"], want)


class _ReadsByThread:
    """The worker's blobs, recording which thread reads each job's pages; a read on the I/O
    thread holds until ``release`` is set."""

    def __init__(self, blobs) -> None:
        self._blobs = blobs
        self.release = threading.Event()
        self.threads: list[str] = []

    def read_many(self, keys, tenant, out):
        name = threading.current_thread().name
        self.threads.append(name)
        if name.startswith("kvci-disk"):
            assert self.release.wait(10)
        return self._blobs.read_many(keys, tenant, out)


def test_a_sync_load_is_read_on_the_steps_thread_unless_the_io_thread_has_one_in_flight(
    setup,
) -> None:
    worker, kv, keys, _ = setup
    reads = worker._blobs = _ReadsByThread(worker._blobs)
    reads.release.set()
    sync_blocks = list(range(8, 16))
    worker.bind(StepJobs(disk_loads=[DiskLoadJob("s1", "alice", keys, sync_blocks, sync=True)]))
    worker.start_load_kv()
    worker.clear()
    assert set(reads.threads) == {threading.current_thread().name}  # nothing to wait for
    for t in kv.values():
        t[sync_blocks] = 0
    # An async load is on the I/O thread, reading into the one staging buffer: the next sync
    # load queues behind it there, and both land whole.
    reads.release.clear()
    reads.threads.clear()
    async_blocks = list(range(PAGES))
    start_load(worker, DiskLoadJob("a1", "alice", keys, async_blocks))
    threading.Timer(0.2, reads.release.set).start()
    worker.bind(StepJobs(disk_loads=[DiskLoadJob("s2", "alice", keys, sync_blocks, sync=True)]))
    worker.start_load_kv()
    worker.clear()
    assert {name.split("_")[0] for name in reads.threads} == {"kvci-disk"}
    assert _step_until_reported(worker, "a1", generation=0) == set()
    for i in range(PAGES):
        assert torch.equal(block_bytes(kv, async_blocks[i]), page_of(i)), i
        assert torch.equal(block_bytes(kv, sync_blocks[i]), page_of(i)), i


def test_a_persist_writes_every_page_of_its_slots(setup) -> None:
    worker, _, _, blobs = setup
    keys = [hashlib.sha256(f"persisted-{i}".encode()).digest()[:16] for i in range(3)]
    slots = [2, 0, 3]
    for i, slot in enumerate(slots):
        worker._pool.write(slot, page_of(100 + i))
    worker.bind(StepJobs(persists=[PersistJob("c1", "alice", keys, slots)]))
    worker.wait_for_save()
    worker.clear()
    assert worker.take_report().persisted == {"c1": 1}
    for i, key in enumerate(keys):
        assert torch.equal(blobs.read(key, "alice"), page_of(100 + i))


def _step_until_reported(worker: KVCIWorker, req_id: str, generation: int) -> set[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        worker.bind(StepJobs(forward=False, generation=generation))
        worker.start_load_kv()
        _, recving = worker.get_finished(set())
        worker.clear()
        if recving:
            assert recving == {req_id}
            return worker.get_block_ids_with_load_errors()
    raise AssertionError("the disk load was never reported")


def test_a_disk_load_in_flight_at_a_reset_is_reported_failed(setup) -> None:
    worker, _, keys, _ = setup
    blocks = list(range(PAGES))
    start_load(worker, DiskLoadJob("r4", "alice", keys, blocks))
    # The next step carries the scheduler's new generation: the load's KV predates the reset.
    assert _step_until_reported(worker, "r4", generation=1) == set(blocks)


def test_after_a_reset_blobs_are_read_and_written_in_the_new_generation(setup, tmp_path) -> None:
    worker, kv, keys, blobs = setup
    blocks = list(range(PAGES))
    assert run_load(worker, DiskLoadJob("r5", "alice", keys, blocks), generation=1) == set(blocks)
    assert all(not block_bytes(kv, b).any() for b in blocks)  # generation 0's blobs: not read
    key = hashlib.sha256(b"new-generation").digest()[:16]
    worker._pool.write(1, page_of(200))
    worker.bind(StepJobs(persists=[PersistJob("c2", "alice", [key], [1])], generation=1))
    worker.wait_for_save()
    worker.clear()
    fresh = FolderBlobRoot(tmp_path / "disk").store(generation_namespace(NS, 1))
    assert torch.equal(fresh.read(key, "alice"), page_of(200)) and not blobs.exists(key)


def test_sleep_drains_refuses_copies_until_the_wake_and_then_copies_again(
        setup, tmp_path) -> None:
    worker, kv, keys, _ = setup
    blocks = list(range(PAGES))
    start_load(worker, DiskLoadJob("r6", "alice", keys, blocks))
    worker.unregister_kv_caches()
    (fut, _, _), = worker._disk_loads.values()
    assert fut.done()  # the load ran to its end before the KV cache memory is released
    worker.bind(StepJobs())  # a step with nothing to copy is fine while asleep
    worker.clear()
    with pytest.raises(RuntimeError, match="asleep"):
        worker.bind(StepJobs(persists=[PersistJob("c3", "alice", keys[:1], [0])]))
    worker.restore_kv_caches()
    # The blocks the load filled lost their memory: recomputed, however the scheduler stands.
    assert _step_until_reported(worker, "r6", generation=0) == set(blocks)
    # The weights may have changed meanwhile: generation 0's KV is fenced (the scheduler is told
    # to reset, see test_worker_release.py), and copies run again in the next generation.
    assert run_load(worker, DiskLoadJob("r7", "alice", keys, blocks)) == set(blocks)
    assert worker.take_report().fence_generation == 0
    fresh = FolderBlobRoot(tmp_path / "disk").store(generation_namespace(NS, 1))
    for i, key in enumerate(keys):
        fresh.write(key, "alice", page_of(i))
    assert run_load(worker, DiskLoadJob("r8", "alice", keys, blocks), generation=1) == set()
    assert all(torch.equal(block_bytes(kv, b), page_of(b)) for b in blocks)
