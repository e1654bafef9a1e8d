"""The worker with its KV cache on a GPU: a store copies what the step's forward wrote (even
while that forward is still running) and is reported only once its copy has run; a load is in
the cache before the next forward reads it, and does not wait for a store still in flight."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from worker_support import NUM_BLOCKS, SLOT, block_bytes, kv_cache, page_of, write_block

from kvci_plugin.connector.jobs import LoadJob, StepJobs, StoreJob
from kvci_plugin.connector.worker import KVCIWorker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STALL_CYCLES = 400_000_000  # about 0.2 s at H200 clocks: the "forward"


@pytest.fixture
def worker(tmp_path: Path):
    kv = kv_cache("cuda")
    w = KVCIWorker(num_slots=4, expected_slot_bytes=SLOT, num_blocks=NUM_BLOCKS,
                   rank_namespace=hashlib.sha256(b"worker-cuda").digest(), blob_root=None)
    w.register_kv_caches(kv)
    # One copy first: the first one allocates (pinned staging, side-stream memory), which may
    # synchronize, and the tests below need a copy that queues behind a running forward.
    w._store_copies.run(lambda: w._pool.store(w._views[0], [0], [0]), SLOT).wait()
    w._load_copies.run(lambda: w._pool.load([0], w._views[0], [0]), SLOT).wait()
    yield w, kv
    w.shutdown()


def test_a_store_waits_for_the_forward_and_is_reported_once_it_ran(worker) -> None:
    w, kv = worker
    written = page_of(6).cuda()
    torch.cuda.synchronize()
    forward = torch.cuda.Stream()  # vLLM's forward runs on a stream of its own
    with torch.cuda.stream(forward):
        w.bind(StepJobs(stores=[StoreJob("r1", "c1", [2], [6])]))
        w.start_load_kv()
        torch.cuda._sleep(STALL_CYCLES)  # the forward, still running when wait_for_save returns
        write_block(kv, 6, written)  # queued, as the page is on the GPU
        w.wait_for_save()
        sending, _ = w.get_finished({"r1"})
        w.clear()
    assert sending is None  # the copy waits behind the forward: vLLM must not free block 6 yet
    deadline = time.monotonic() + 30
    while sending is None and time.monotonic() < deadline:
        sending, _ = w.get_finished(set())
    assert sending == {"r1"}
    assert torch.equal(w._pool.read(2), page_of(6))
    assert w.take_stats().reduce()["stored_bytes_ram"] == SLOT


def test_the_next_forward_reads_a_loaded_page(worker) -> None:
    w, kv = worker
    w._pool.write(1, page_of(40))
    torch.cuda._sleep(STALL_CYCLES)  # an earlier forward keeps the stream busy
    w.bind(StepJobs(loads=[LoadJob("r2", [1], [9])]))
    w.start_load_kv()
    assert torch.equal(block_bytes(kv, 9), page_of(40))  # read on the forward's stream
    w.clear()


def test_a_load_does_not_queue_behind_a_store_in_flight(worker) -> None:
    w, kv = worker
    w._pool.write(1, page_of(41))
    stalled = torch.cuda.Stream()  # a forward still running when the next step starts
    with torch.cuda.stream(stalled):
        w.bind(StepJobs(stores=[StoreJob("r1", "c1", [2], [6])]))
        w.start_load_kv()
        torch.cuda._sleep(STALL_CYCLES)
        w.wait_for_save()  # queued behind the stall
        w.clear()
    nxt = torch.cuda.Stream()  # the next step's forward
    with torch.cuda.stream(nxt):
        w.bind(StepJobs(loads=[LoadJob("r2", [1], [9])]))
        w.start_load_kv()
        assert torch.equal(block_bytes(kv, 9), page_of(41))  # waits for the load only
        sending, _ = w.get_finished({"r1"})
        w.clear()
    assert sending is None  # the store is still behind the stalled forward
    torch.cuda.synchronize()
