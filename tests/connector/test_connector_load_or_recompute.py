"""The scheduler side takes a disk hit unless this engine measured that recomputing it is clearly
faster, and reads it in the request's own step when there is no other request to run (no engine: a
real vLLM Request, a real disk tier, the workers' load reports as vLLM delivers them)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from support.disk_tier import DiskTierForTests
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.metadata import KVCIMetadata, KVCIWorkerMetadata
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver

BS = 32
SLOT = 1 << 20
PROMPT = list(range(1, 4 * BS + 2))  # 4 full blocks and one token to compute
NS = hashlib.sha256(b"load-or-recompute").digest()


def request(req_id: str) -> Request:
    return Request(req_id, list(PROMPT), SamplingParams(max_tokens=1), None)


def step(scheduler: KVCIScheduler, scheduled: dict[str, int]) -> KVCIMetadata:
    return scheduler.build_connector_meta(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[]))  # only the fields every supported vLLM has


def disk_and_scheduler(tmp_path: Path) -> tuple[DiskTierForTests, KVCIScheduler]:
    disk = DiskTierForTests(tmp_path / "disk", NS, 64 * SLOT)
    return disk, KVCIScheduler(
        config=KVCIConfig(disk_root=tmp_path / "disk", ram_bytes=8 * SLOT), block_size=BS,
        slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
        tenants=TenantResolver(None), disk=disk)


def report_loads(scheduler: KVCIScheduler, *loads: tuple[int, float]) -> None:
    meta = KVCIWorkerMetadata(disk_loads=list(loads))
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))


def test_a_disk_hit_is_declined_once_loads_measure_slower_than_recompute(tmp_path: Path) -> None:
    disk, scheduler = disk_and_scheduler(tmp_path)
    st = scheduler.requests.state(request("seed"))
    disk.persist("c1", st.tenant, st.keys, torch.zeros((4, SLOT), dtype=torch.uint8), "user",
                 "{}", "{}", None)

    # Nothing measured yet: the hit is taken, asynchronously.
    assert scheduler.get_num_new_matched_tokens(request("r1"), 0) == (4 * BS, True)

    # A prompt computed whole (no hit) in about 0.2 s measures the recompute rate: ~1.5 ms a
    # token. 4 MiB at 1 MiB/s = 4 s against recomputing 128 tokens: declined, once.
    fresh = Request("p", [t + 10_000 for t in PROMPT], SamplingParams(max_tokens=4), None)
    assert scheduler.get_num_new_matched_tokens(fresh, 0) == (0, False)
    step(scheduler, {"p": len(PROMPT)})
    time.sleep(0.2)
    step(scheduler, {"p": 1})  # decoding: the prompt's forward has run
    report_loads(scheduler, (SLOT, 1.0))
    slow = request("r2")
    assert scheduler.get_num_new_matched_tokens(slow, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(slow, 0) == (0, False)  # vLLM may ask again
    assert scheduler.take_stats().reduce()["disk_hits_declined"] == 1

    # Faster loads reported by the workers bring the hit back.
    report_loads(scheduler, *[(SLOT, 0.001)] * 4)
    assert scheduler.get_num_new_matched_tokens(request("r3"), 0) == (4 * BS, True)
    disk.close()


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self._ids,)


def test_a_disk_hit_is_read_in_its_own_step_only_while_no_other_request_is_known(
    tmp_path: Path,
) -> None:
    disk, scheduler = disk_and_scheduler(tmp_path)
    seed = request("seed")
    st = scheduler.requests.state(seed)
    disk.persist("c1", st.tenant, st.keys, torch.zeros((4, SLOT), dtype=torch.uint8), "user",
                 "{}", "{}", None)
    scheduler.request_finished(seed, [[]])

    # Alone: read before its forward (vLLM counts it a sync load), in the step that plans it.
    alone = request("r1")
    assert scheduler.get_num_new_matched_tokens(alone, 0) == (4 * BS, False)
    scheduler.update_state_after_alloc(alone, _Blocks([5, 6, 7, 8, 9]), 4 * BS)
    # Another request is known (r1 runs): its hit is read on steps of its own.
    assert scheduler.get_num_new_matched_tokens(request("r2"), 0) == (4 * BS, True)
    scheduler.update_state_after_alloc(request("r2"), _Blocks([1, 2, 3, 4, 0]), 4 * BS)
    meta = step(scheduler, {"r1": 1})
    assert [(job.req_id, job.sync, job.block_ids) for job in meta.disk_loads] == [
        ("r1", True, [5, 6, 7, 8]), ("r2", False, [1, 2, 3, 4])]
    disk.close()


def test_the_catalog_is_asked_only_when_a_disk_hit_could_add_blocks(tmp_path: Path) -> None:
    disk, scheduler = disk_and_scheduler(tmp_path)
    st = scheduler.requests.state(request("seed"))
    disk.persist("c1", st.tenant, st.keys, torch.zeros((4, SLOT), dtype=torch.uint8), "user",
                 "{}", "{}", None)
    asked: list[int] = []
    catalog_lookup = disk.longest_prefix
    disk.longest_prefix = lambda keys, tenant: (
        asked.append(len(keys)) or catalog_lookup(keys, tenant)
    )  # type: ignore[method-assign]

    # vLLM's prefix cache holds every block a hit could cover: nothing to ask the catalog.
    assert scheduler.get_num_new_matched_tokens(request("r1"), 4 * BS) == (0, False)
    assert asked == []
    # It holds two: the disk tier serves the other two.
    assert scheduler.get_num_new_matched_tokens(request("r2"), 2 * BS) == (2 * BS, True)
    assert asked == [4]
    disk.close()
