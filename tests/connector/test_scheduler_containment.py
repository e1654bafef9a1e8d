"""The scheduler side contains kvci's failures (no engine: real vLLM Requests, the real scheduler,
RAM index and a real SQLite disk tier): a forget between a lookup and the allocation fails the
planned load so vLLM recomputes its blocks, a bug in the keep decision keeps nothing new and
holds a queued store's blocks, and a disk tier whose catalog does not answer is skipped,
counted and comes back by itself."""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.metadata import KVCIWorkerMetadata
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.timeouts import DependencyTimeouts

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"containment").digest()
PROMPT = list(range(1, 3 * BS + 2))  # three full blocks and one token


class Blocks:
    """What vLLM hands update_state_after_alloc: each KV cache group's block ids."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self._ids,)


def request(req_id: str, prompt: list[int] = PROMPT, **kvci: Any) -> Request:
    params = {"kv_transfer_params": {"kvci": kvci}} if kvci else None
    return Request(req_id, prompt, SamplingParams(max_tokens=1, extra_args=params), None)


def finish(scheduler: KVCIScheduler, req: Request) -> tuple[bool, dict[str, Any] | None]:
    req.num_computed_tokens = len(req.prompt_token_ids)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return scheduler.request_finished(req, [[10, 11, 12, 13]])


def scheduler(disk: KVCheckpointStore | None = None) -> KVCIScheduler:
    return KVCIScheduler(config=KVCIConfig(ram_bytes=64 * SLOT, ram_policy="lru"), block_size=BS,
                         slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
                         tenants=TenantResolver(None), disk=disk)


def kept(s: KVCIScheduler, tenant: str = "acme") -> None:
    """The prompt's KV, stored in RAM and committed as the workers would report it."""
    req = request("writer", tenant=tenant, checkpoint="now")
    s.get_num_new_matched_tokens(req, 0)
    delay, _ = finish(s, req)
    assert delay
    s.build_connector_meta(StepOutput())
    s.update_connector_output(Output(finished_sending={"writer"}))


class StepOutput:
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens = 0


class Output:
    def __init__(self, finished_sending: set[str] = frozenset()) -> None:
        self.finished_sending = finished_sending
        self.kv_connector_worker_meta = None


def faults(s: KVCIScheduler) -> dict[str, float]:
    stats = s.take_stats()
    return {k: v for k, v in (stats.reduce() if stats else {}).items() if k.startswith("faults_")}


def test_a_forget_between_lookup_and_allocation_fails_the_load_for_recompute() -> None:
    s = scheduler()
    kept(s)
    reader = request("reader", tenant="acme")
    assert s.get_num_new_matched_tokens(reader, 0) == (3 * BS, False)
    s.manager.forget("acme")  # the control surface's thread, between the two hooks
    s.update_state_after_alloc(reader, Blocks([20, 21, 22, 23]), 3 * BS)  # must not raise
    meta = s.build_connector_meta(StepOutput())
    assert meta.loads == []
    assert [(f.req_id, f.block_ids, f.asynchronous) for f in meta.failed_loads] == [
        ("reader", [20, 21, 22], False)]
    assert faults(s) == {"faults_ram_internal": 1}
    assert s.build_connector_meta(StepOutput()).failed_loads == []  # told once


def test_a_forget_asked_between_lookup_and_allocation_waits_for_the_steps_loads(
        monkeypatch) -> None:
    s = scheduler()
    kept(s)
    # Authorizing a forget is the erasure tests' concern, not this one's:
    monkeypatch.setattr(s.requests.tenants, "authorize_forget", lambda *a: None)
    reader = request("reader", tenant="acme", checkpoint="now")
    assert s.get_num_new_matched_tokens(reader, 0) == (3 * BS, False)
    with ThreadPoolExecutor(1) as pool:  # the control surface's thread
        forgot = pool.submit(s.control.forget_tenant, "acme", None, ())
        with pytest.raises(TimeoutError):
            forgot.result(timeout=0.2)  # not between the lookup and the load it counts on
        s.update_state_after_alloc(reader, Blocks([20, 21, 22, 23]), 3 * BS)
        meta = s.build_connector_meta(StepOutput())
        assert forgot.result(timeout=5).ram_checkpoints == 1
    assert [job.req_id for job in meta.loads] == ["reader"] and meta.failed_loads == []
    assert faults(s) == {}
    # Once the step's loads were planned, nothing of the tenant's is found again...
    assert s.get_num_new_matched_tokens(request("again", tenant="acme"), 0) == (0, False)
    s.build_connector_meta(StepOutput())  # the step's load is done: its pins end
    assert s.manager.index.stats().bytes_used == 0
    # ...nor kept from a request that began before the forget, though it asks to be.
    delay, reply = finish(s, reader)
    assert not delay and reply is not None and reply["kvci"]["tier"] == "none"
    assert s.manager.index.stats().bytes_used == 0


def test_a_load_the_workers_failed_is_no_hit_in_the_reply() -> None:
    s = scheduler()
    kept(s)
    reader = request("reader", tenant="acme")
    assert s.get_num_new_matched_tokens(reader, 0) == (3 * BS, False)
    s.update_state_after_alloc(reader, Blocks([20, 21, 22, 23]), 3 * BS)
    assert [job.req_id for job in s.build_connector_meta(StepOutput()).loads] == ["reader"]
    output = Output()
    output.kv_connector_worker_meta = KVCIWorkerMetadata(failed_loads=["reader"])
    s.update_connector_output(output)  # vLLM recomputes the blocks
    _, reply = finish(s, reader)
    assert reply is not None
    assert (reply["kvci"]["hit_tokens"], reply["kvci"]["hit_tier"]) == (0, None)
    stats = s.take_stats()
    assert stats is not None and stats.reduce()["failed_hit_tokens_ram"] == 3 * BS


def test_a_bug_in_the_keep_decision_keeps_nothing_new_and_is_logged_with_its_traceback(
        monkeypatch, caplog) -> None:
    s = scheduler()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a scorer bug")

    monkeypatch.setattr(s.manager.advisor, "recommend", broken)
    req = request("r", tenant="acme", checkpoint="now")
    s.get_num_new_matched_tokens(req, 0)
    with caplog.at_level(logging.ERROR, logger="kvci_plugin"):
        delay, reply = finish(s, req)
    assert delay is False  # nothing was queued: vLLM frees the blocks now
    assert "contained fault" in reply["kvci"]["error"]
    assert faults(s) == {"faults_ram_internal": 1}
    (record,) = [r for r in caplog.records if "deciding what to keep" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
    assert s.manager.index.stats().entries == 0


def test_a_store_queued_before_a_failure_still_holds_its_blocks(monkeypatch) -> None:
    s = scheduler()
    real = s.keeper.count_outcome

    def count_then_fail(outcome: Any) -> None:
        real(outcome)
        raise RuntimeError("a bug after the store was queued")

    monkeypatch.setattr(s.keeper, "count_outcome", count_then_fail)
    req = request("r", tenant="acme", checkpoint="now")
    s.get_num_new_matched_tokens(req, 0)
    delay, _ = finish(s, req)
    assert delay is True  # the queued copy reads these blocks: vLLM must keep them
    meta = s.build_connector_meta(StepOutput())
    assert [job.req_id for job in meta.stores] == ["r"]
    s.update_connector_output(Output(finished_sending={"r"}))
    assert s.manager.index.stats().pending_entries == 0  # committed, not stuck pending


def test_a_store_a_worker_failed_is_never_loadable() -> None:
    from kvci_plugin.connector.metadata import KVCIWorkerMetadata

    s = scheduler()
    req = request("writer", tenant="acme", checkpoint="now")
    s.get_num_new_matched_tokens(req, 0)
    assert finish(s, req)[0]
    s.build_connector_meta(StepOutput())
    out = Output(finished_sending={"writer"})
    out.kv_connector_worker_meta = KVCIWorkerMetadata(failed_stores=["writer"])
    s.update_connector_output(out)
    assert s.get_num_new_matched_tokens(request("reader", tenant="acme"), 0) == (0, False)
    assert s.manager.index.stats().entries == 0


@pytest.fixture
def pg_disk(tmp_path: Path, pg_catalog_url: str):
    store = KVCheckpointStore(tmp_path / "disk", NS, 1 << 30, catalog_url=pg_catalog_url)
    store.health._first_probe_s = 0.05
    yield store
    store.close()


def test_a_catalog_that_does_not_answer_is_a_miss_then_skipped_until_it_answers(
        pg_disk, pg_catalog_url) -> None:
    import psycopg

    s = scheduler(pg_disk)
    # A real stall: another session holds the pages table in an exclusive lock, so the lookup's
    # read waits on the server until that session lets go.
    other = psycopg.connect(pg_catalog_url)
    other.execute("LOCK TABLE pages IN ACCESS EXCLUSIVE MODE")
    try:
        t0 = time.monotonic()
        assert s.get_num_new_matched_tokens(request("a", tenant="acme"), 0) == (0, False)
        bound = DependencyTimeouts().statement_s + DependencyTimeouts().lock_s
        assert time.monotonic() - t0 < bound + 1.0  # bounded, not until the lock goes
        assert pg_disk.health.report().state == "degraded"
        assert faults(s) == {"faults_disk_timeout": 1}
        t0 = time.monotonic()
        assert s.get_num_new_matched_tokens(request("b", tenant="acme"), 0) == (0, False)
        assert time.monotonic() - t0 < 0.5  # skipped, not asked again
        assert faults(s) == {}  # a skip is not another fault
        report = s.manager.ram_stats()["disk"]
        assert report["health"]["state"] == "degraded" and report["checkpoints"] is None
    finally:
        other.rollback()
        other.close()
    deadline = time.monotonic() + 10
    while pg_disk.health.report().state != "healthy":
        assert time.monotonic() < deadline, "the probe never found the catalog back"
        time.sleep(0.05)
    assert s.get_num_new_matched_tokens(request("c", tenant="acme"), 0) == (0, False)
    assert faults(s) == {}
    assert s.manager.ram_stats()["disk"]["checkpoints"] == 0
