"""The worker's RAM-tier copies on real KV cache tensors (no engine): stores and loads land
whole, a store is reported once and only for a finished request, a persist in the same step
writes what that step stored. Runs with the cache on a GPU too (``KV_DEVICES``)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from worker_support import KV_DEVICES, NUM_BLOCKS, SLOT, block_bytes, kv_cache, page_of, write_block

from kvci_plugin.connector.jobs import LoadJob, PersistJob, StepJobs, StoreJob
from kvci_plugin.connector.worker import KVCIWorker
from kvci_plugin.tiering.blobs.folder import FolderBlobRoot

NS = hashlib.sha256(b"worker-copies").digest()


@pytest.fixture(params=KV_DEVICES)
def setup(request: pytest.FixtureRequest, tmp_path: Path):
    kv = kv_cache(request.param)
    for block in range(NUM_BLOCKS):
        write_block(kv, block, page_of(block))
    worker = KVCIWorker(num_slots=6, expected_slot_bytes=SLOT, num_blocks=NUM_BLOCKS,
                        rank_namespace=NS, blob_root=FolderBlobRoot(tmp_path / "disk"))
    worker.register_kv_caches(kv)
    yield worker, kv, FolderBlobRoot(tmp_path / "disk").store(NS)
    worker.shutdown()


def step(worker: KVCIWorker, jobs: StepJobs, finished: set[str]) -> set[str]:
    worker.bind(jobs)
    worker.start_load_kv()
    worker.wait_for_save()
    sending, _ = worker.get_finished(finished)
    worker.clear()
    return sending or set()


def sent_within(worker: KVCIWorker, req_id: str, seen: set[str], seconds: float = 30) -> set[str]:
    """Step with no jobs until ``req_id``'s store is reported (``seen``: reported so far);
    everything reported by then."""
    seen = set(seen)
    deadline = time.monotonic() + seconds
    while req_id not in seen and time.monotonic() < deadline:
        seen |= step(worker, StepJobs(), set())
    return seen


def test_stored_pages_load_back_into_other_blocks(setup) -> None:
    worker, kv, _ = setup
    sources, slots = [3, 9, 14], [5, 0, 2]
    reported = step(worker, StepJobs(stores=[StoreJob("r1", "c1", slots, sources)]), {"r1"})
    assert sent_within(worker, "r1", reported) == {"r1"}
    targets = [1, 7, 12]
    for block in targets:
        write_block(kv, block, torch.zeros(SLOT, dtype=torch.uint8))
    step(worker, StepJobs(loads=[LoadJob("r2", slots, targets)]), set())
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(block_bytes(kv, target), page_of(source))
    totals = worker.take_stats().reduce()
    assert totals["stored_bytes_ram"] == totals["loaded_bytes_ram"] == 3 * SLOT


def test_a_store_is_reported_once_and_only_when_its_request_finished(setup) -> None:
    worker, _, _ = setup
    # The finished id came a step before the job (async scheduling may split them).
    assert step(worker, StepJobs(), {"early"}) == set()
    reported = step(worker, StepJobs(stores=[StoreJob("early", "c1", [0], [4])]), set())
    assert sent_within(worker, "early", reported) == {"early"}
    # A request never reported finished is not reported, nor one with nothing stored.
    assert step(worker, StepJobs(stores=[StoreJob("running", "c2", [1], [5])]), {"other"}) == set()
    assert sent_within(worker, "running", set(), seconds=0.5) == set()


def test_a_persist_writes_what_its_step_stored(setup) -> None:
    worker, _, blobs = setup
    keys = [hashlib.sha256(f"k{i}".encode()).digest()[:16] for i in range(2)]
    step(worker, StepJobs(stores=[StoreJob("r1", "c1", [4, 1], [10, 6])],
                          persists=[PersistJob("c1", "alice", keys, [4, 1])]), {"r1"})
    assert worker.take_report().persisted == {"c1": 1}
    assert torch.equal(blobs.read(keys[0], "alice"), page_of(10))
    assert torch.equal(blobs.read(keys[1], "alice"), page_of(6))


def layer_bytes(kv: dict[str, torch.Tensor], name: str, block: int) -> torch.Tensor:
    return kv[name][block].contiguous().view(torch.uint8).flatten().cpu()


@pytest.fixture
def cpu_stored():
    """A worker on a CPU cache with three pages stored: (worker, kv, sources, slots, targets),
    the pages of blocks ``sources`` in ``slots``, ``targets`` the blocks a load fills."""
    kv = kv_cache("cpu")
    for block in range(NUM_BLOCKS):
        write_block(kv, block, page_of(block))
    worker = KVCIWorker(num_slots=6, expected_slot_bytes=SLOT, num_blocks=NUM_BLOCKS,
                        rank_namespace=NS, blob_root=None)
    worker.register_kv_caches(kv)
    try:
        sources, slots, targets = [3, 9, 14], [5, 0, 2], [1, 7, 12]
        reported = step(worker, StepJobs(stores=[StoreJob("r1", "c1", slots, sources)]), {"r1"})
        assert sent_within(worker, "r1", reported) == {"r1"}
        yield worker, kv, sources, slots, targets
    finally:
        worker.shutdown()


def test_a_cpu_load_is_in_place_for_each_layer_when_the_forward_reaches_it(cpu_stored) -> None:
    worker, kv, sources, slots, targets = cpu_stored
    half = SLOT // 2  # each of the two layers holds half a slot

    def load(waits: list[str]) -> dict[str, list[torch.Tensor]]:
        """One step loading the pages into ``targets``; each layer's bytes there when the
        forward waits for it (``waits``, in order) and right after ``start_load_kv``."""
        for block in targets:
            write_block(kv, block, torch.zeros(SLOT, dtype=torch.uint8))
        worker.bind(StepJobs(loads=[LoadJob("r2", slots, targets)]))
        worker.start_load_kv()
        seen = {"start": [torch.cat([layer_bytes(kv, "layer.1", b) for b in targets])],
                "start.0": [torch.cat([layer_bytes(kv, "layer.0", b) for b in targets])]}
        for name in waits:
            worker.wait_for_layer_load(name)
            seen[name] = [layer_bytes(kv, name, b) for b in targets]
        worker.wait_for_save()
        worker.get_finished(set())
        worker.clear()
        for source, target in zip(sources, targets, strict=True):
            assert torch.equal(
                block_bytes(kv, target), page_of(source)
            )  # whole once the step ends
        return seen

    # The first load: no layer is known to wait, so every page is in before the forward.
    first = load(["layer.0"])
    assert torch.equal(first["start"][0], torch.cat([page_of(s)[half:] for s in sources]))
    assert torch.equal(first["start.0"][0], torch.cat([page_of(s)[:half] for s in sources]))
    # Later ones: layer 0, seen waiting, is copied when the forward waits for it, and not
    # before; layer 1 never waited, so it is copied before the forward starts, as before.
    for _ in range(3):
        later = load(["layer.0"])
        assert torch.equal(later["start"][0], torch.cat([page_of(s)[half:] for s in sources]))
        assert not later["start.0"][0].any()
        for got, source in zip(later["layer.0"], sources, strict=True):
            assert torch.equal(got, page_of(source)[:half])
    # A step whose forward waits for nothing still ends with every page in (its finish
    # copies layer 0), and layer 0 stays deferred in the steps after it.
    load([])
    assert not load(["layer.0"])["start.0"][0].any()
    totals = worker.take_stats().reduce()
    assert totals["loaded_bytes_ram"] == 6 * 3 * SLOT


def test_layers_a_step_without_forward_started_are_in_when_the_next_forward_reads_them(
        cpu_stored) -> None:
    """vLLM calls no ``wait_for_save`` in a step without a forward: layers its loads deferred
    are still to be copied in the next step, whose forward waits for them though it loads
    nothing itself (the connector's per-layer hook asks ``layers_loading`` first)."""
    worker, kv, sources, slots, targets = cpu_stored
    assert not worker.layers_loading  # steps without loads: the hook returns at once
    half = SLOT // 2

    def zero_targets() -> None:
        for block in targets:
            write_block(kv, block, torch.zeros(SLOT, dtype=torch.uint8))

    # A load whose forward waits for layer 0: from now on layer 0 is copied when waited for.
    worker.bind(StepJobs(loads=[LoadJob("r2", slots, targets)]))
    worker.start_load_kv()
    worker.wait_for_layer_load("layer.0")
    worker.wait_for_save()
    worker.get_finished(set())
    worker.clear()
    zero_targets()
    # A step without a forward starts the load (layer 0 deferred) and has no wait_for_save.
    worker.bind(StepJobs(loads=[LoadJob("r3", slots, targets)], forward=False))
    worker.start_load_kv()
    worker.get_finished(set())
    worker.clear()
    assert not layer_bytes(kv, "layer.0", targets[0]).any()
    # The next step loads nothing; its forward reads layer 0.
    worker.bind(StepJobs())
    worker.start_load_kv()
    assert worker.layers_loading
    worker.wait_for_layer_load("layer.0")
    for got, source in zip([layer_bytes(kv, "layer.0", b) for b in targets], sources,
                           strict=True):
        assert torch.equal(got, page_of(source)[:half])
    worker.wait_for_save()
    assert not worker.layers_loading
    worker.get_finished(set())
    worker.clear()


def test_a_window_store_is_copied_and_reported_the_same_step(setup) -> None:
    """A running request's window (#47): copied in its step, reported by its stage id (on the
    CPU at once; on a GPU once the copy ran), never as a finished request's store (vLLM would
    free the blocks of a request still running)."""
    worker, kv, _ = setup
    job = StoreJob("running", "kvci-window-1", [2, 4], [6, 11], [0, 0])
    sending = step(worker, StepJobs(window_stores=[job]), {"running"})
    assert sending == set()
    deadline = time.monotonic() + 30
    report = worker.take_report()
    while (report is None or "kvci-window-1" not in report.window_stored) \
            and time.monotonic() < deadline:
        step(worker, StepJobs(), set())
        report = worker.take_report()
    assert report is not None and report.window_stored == {"kvci-window-1": 1}
    # The slots hold the blocks as they were: overwritten after the step, still the old bytes.
    write_block(kv, 6, torch.zeros(SLOT, dtype=torch.uint8))
    step(worker, StepJobs(loads=[LoadJob("r2", [2, 4], [1, 7])]), set())
    assert torch.equal(block_bytes(kv, 1), page_of(6))
    assert torch.equal(block_bytes(kv, 7), page_of(11))
    assert worker.take_stats().reduce()["stored_bytes_ram"] == 2 * SLOT
