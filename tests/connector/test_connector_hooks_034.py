"""vLLM 0.34's connector hooks, answered by the real scheduler side (no engine: real vLLM
Requests, the real KVCIScheduler, RAM index and a SQLite disk tier; these hooks' signatures are
held to vLLM's by tests/connector/test_connector_contract.py, on 0.33 and 0.34 sources too).

- ``may_load_async``: yes exactly when a disk hit is still possible (disk tier on and healthy,
  the request keyable and allowed external KV, a block to load, RAM not holding it all), and it
  computes the request's keys once, for the lookup that follows;
- the fence after a release of the KV cache (sleep, a weight update): the workers' report makes
  the scheduler reset its tiers as ``reset`` does, unless it has already;
- ``Request.kv_hints``: read as plain data, in any shape, never failing a request.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.metadata import KVCIWorkerMetadata
from kvci_plugin.connector.release_fence import fence_after_release
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.connector.speculative import has_drafter, note_at_start
from kvci_plugin.request.hints import MAX_ACTIONS, KVHints, read_kv_hints
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.disk.tier import KVCheckpointStore

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"hooks-034").digest()
PROMPT = list(range(1, 3 * BS + 2))  # three full blocks and one token


class StepOutput:
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens = 0


class Output:
    def __init__(self, finished_sending: set[str] = frozenset(), meta: Any = None) -> None:
        self.finished_sending = finished_sending
        self.kv_connector_worker_meta = meta


def request(req_id: str, prompt: list[int] = PROMPT, *, params: SamplingParams | None = None,
            **kvci: Any) -> Request:
    extra = {"kv_transfer_params": {"kvci": kvci}} if kvci else None
    return Request(req_id, prompt, params or SamplingParams(max_tokens=1, extra_args=extra), None)


def scheduler(disk: KVCheckpointStore | None = None) -> KVCIScheduler:
    return KVCIScheduler(config=KVCIConfig(ram_bytes=64 * SLOT, ram_policy="lru"), block_size=BS,
                         slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
                         tenants=TenantResolver(None), disk=disk)


@pytest.fixture
def disk(tmp_path: Path):
    store = KVCheckpointStore(tmp_path / "disk", NS, 1 << 30)
    yield store
    store.close()


def kept_in_ram(s: KVCIScheduler) -> None:
    """The prompt's KV, stored in RAM and committed as the workers would report it."""
    writer = request("writer", checkpoint="now")
    s.get_num_new_matched_tokens(writer, 0)
    writer.num_computed_tokens = len(PROMPT)
    writer.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, _ = s.request_finished(writer, [[10, 11, 12, 13]])
    assert delay
    s.build_connector_meta(StepOutput())
    s.update_connector_output(Output(finished_sending={"writer"}))


# ---- may_load_async -------------------------------------------------------------------------

def test_no_disk_tier_no_asynchronous_load() -> None:
    assert scheduler().may_load_async(request("r")) is False


def test_a_keyable_request_may_load_from_a_healthy_disk_tier(disk) -> None:
    s = scheduler(disk)
    r = request("r")
    assert s.may_load_async(r) is True
    # Its keys were made once, for the lookup that follows (which finds nothing here).
    keys = s.requests.get("r").keys
    assert keys is not None and len(keys) == 3
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.requests.get("r").keys is keys


def test_what_rules_an_asynchronous_load_out(disk) -> None:
    s = scheduler(disk)
    assert s.may_load_async(request("short", list(range(1, BS + 1)))) is False  # no block to load
    assert s.may_load_async(request("bad", kvci_unknown_field=1)) is False  # params refused
    no_reads = SamplingParams(max_tokens=1, skip_reading_prefix_cache=True)
    assert s.may_load_async(request("skips", params=no_reads)) is False  # vLLM drops its hit
    embeds = request("embeds")
    embeds.prompt_embeds = object()  # placeholder token ids: not keyable
    assert s.may_load_async(embeds) is False
    disk.health.failed(RuntimeError("catalog down"), "a test")  # degraded: lookups skip it
    assert s.may_load_async(request("degraded")) is False


def test_a_prefix_ram_holds_whole_loads_synchronously(disk) -> None:
    s = scheduler(disk)
    kept_in_ram(s)
    reader = request("reader")
    assert s.may_load_async(reader) is False  # RAM's hit: copied beside the forward
    assert s.get_num_new_matched_tokens(reader, 0) == (3 * BS, False)
    longer = request("longer", PROMPT + list(range(500, 500 + 2 * BS)))
    assert s.may_load_async(longer) is True  # the disk tier could still hold the rest


def test_a_failure_answers_no_and_is_contained(disk, monkeypatch) -> None:
    s = scheduler(disk)

    def broken(request: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(s.requests, "state", broken)
    assert s.may_load_async(request("r")) is False
    assert s.take_stats().reduce()["faults_ram_internal"] == 1


# ---- the fence after a release of the KV cache --------------------------------------------------

def test_a_release_the_scheduler_did_not_reset_for_resets_its_tiers() -> None:
    s = scheduler()
    kept_in_ram(s)
    assert s.get_num_new_matched_tokens(request("before"), 0) == (3 * BS, False)
    g = s.generation
    meta = KVCIWorkerMetadata(fence_generation=g)  # a worker restored its KV cache in g
    assert fence_after_release(s, meta) is True
    s.update_connector_output(Output(meta=meta))  # applies the reset first, as the connector does
    assert s.generation == g + 1
    # Nothing from before loads: RAM forgot it, and the same prompt is keyed anew.
    assert s.get_num_new_matched_tokens(request("after"), 0) == (0, False)
    assert s.take_stats().reduce()["cache_resets"] == 1
    # The same report again (another rank's, a later step's): already past it.
    assert fence_after_release(s, meta) is False
    assert fence_after_release(s, KVCIWorkerMetadata()) is False


def test_a_release_after_vllms_own_reset_resets_nothing_more() -> None:
    s = scheduler()
    g = s.generation
    s.reset()  # vLLM's reset_cache before the sleep (reset_connector=True, the default)
    assert fence_after_release(s, KVCIWorkerMetadata(fence_generation=g)) is False
    assert s.generation == g + 1


def test_ranks_reports_merge_to_the_newest_fence() -> None:
    a, b = KVCIWorkerMetadata(fence_generation=3), KVCIWorkerMetadata(fence_generation=None)
    assert a.aggregate(b).fence_generation == 3 and b.aggregate(a).fence_generation == 3
    assert not KVCIWorkerMetadata(fence_generation=0).is_empty()


# ---- Request.kv_hints ---------------------------------------------------------------------------

def envelope(*actions: Any) -> Any:
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope(protocol_version="1", message_id="m-1", actions=[
        KvHintAction(action_id=f"a{i}", action_type=kind, action_version="1", payload=payload)
        for i, (kind, payload) in enumerate(actions)])


def test_a_request_carrying_kv_hints_is_read_and_served() -> None:
    r = request("r")
    r.kv_hints = envelope(("retain", {"ttl_s": 30}), ("evict", {}))
    hints = read_kv_hints(r)
    assert isinstance(hints, KVHints) and hints.problems == ()
    assert (hints.protocol_version, hints.message_id) == ("1", "m-1")
    assert [a.action_type for a in hints.actions] == ["retain", "evict"]
    assert hints.of_type("retain")[0].payload == {"ttl_s": 30}
    # The scheduler side serves it as any other request.
    s = scheduler()
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    r.num_computed_tokens, r.status = len(PROMPT), RequestStatus.FINISHED_LENGTH_CAPPED
    s.request_finished(r, [[1, 2, 3, 4]])


def test_a_request_built_with_kv_hints_by_vllm() -> None:
    """As vLLM's engine core builds it (``Request(..., kv_hints=...)``)."""
    r = Request("r", PROMPT, SamplingParams(max_tokens=1), None,
                kv_hints=envelope(("retain", {})))
    assert [a.action_id for a in read_kv_hints(r).actions] == ["a0"]


@pytest.mark.parametrize("carried", [
    None,
    {"protocol_version": "2", "message_id": "m", "actions": [
        {"action_id": "x", "action_type": "t", "action_version": "9", "payload": {}}]},
    {"protocol_version": 2, "actions": "not a list"},
    SimpleNamespace(protocol_version="1", message_id="m", actions=[object(), None]),
    SimpleNamespace(protocol_version="1", message_id="m", actions=[
        {"action_id": "x", "action_type": "t", "action_version": "1", "payload": {}}] * 100),
    "a string",
    object(),
])
def test_kv_hints_of_any_shape_never_fail(carried: Any) -> None:
    hints = read_kv_hints(SimpleNamespace(kv_hints=carried))
    if carried is None:
        assert hints is None
        return
    assert isinstance(hints, KVHints)
    assert len(hints.actions) <= MAX_ACTIONS
    if isinstance(carried, dict) and carried.get("protocol_version") == "2":
        assert hints.problems == () and hints.actions[0].action_version == "9"
    else:
        assert hints.problems  # named, for a log line


def test_a_vllm_without_kv_hints_reads_none() -> None:
    assert read_kv_hints(SimpleNamespace()) is None


# ---- speculative decoding: said at start --------------------------------------------------------

def test_a_drafter_is_named_at_start(caplog) -> None:
    eagle = SimpleNamespace(speculative_config=SimpleNamespace(use_eagle=lambda: True,
                                                               uses_draft_model=lambda: False))
    ngram = SimpleNamespace(speculative_config=SimpleNamespace(use_eagle=lambda: False,
                                                               uses_draft_model=lambda: False))
    assert has_drafter(eagle) and not has_drafter(ngram)
    assert not has_drafter(SimpleNamespace(speculative_config=None))
    with caplog.at_level("WARNING", logger="kvci_plugin.connector.speculative"):
        assert note_at_start(eagle) is True
        assert note_at_start(ngram) is False
    assert [r.message for r in caplog.records if "supports_lookahead_block_hashes" in r.message]
