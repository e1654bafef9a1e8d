"""The engine's own word on a turn's end (#49), on the scheduler side (no engine: real vLLM
Requests, the real scheduler, keep decision and RAM tier): a turn whose output ids hold the model's
tool-call marker is told `tool_call: true` and retained through the pause for the learned TTL; the
session's next request ends the retention; a client's word wins over the engine's, a client's own
`retain` replaces the automatic one, and a model without markers says nothing."""

from __future__ import annotations

import hashlib
from typing import Any

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.policy.return_gaps import TOOL_CALL
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.request.tool_calls import ToolCallMarkers, find_markers

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"tool-calls").digest()
MARKER = 500
MARKERS = find_markers({"<tool_call>": MARKER, "hello": 7})


def scheduler(markers: ToolCallMarkers | None = MARKERS) -> KVCIScheduler:
    return KVCIScheduler(config=KVCIConfig(ram_bytes=64 * SLOT, ram_policy="lru"), block_size=BS,
                         slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
                         tenants=TenantResolver(None), disk=None, markers=markers)


def turn(s: KVCIScheduler, req_id: str, output: list[int], prompt_start: int = 1,
         **kvci: Any) -> dict[str, Any]:
    """One request of session s-1 looked up, run and finished with ``output``: its reply."""
    params = {"kv_transfer_params": {"kvci": {"tenant": "acme", "session_id": "s-1", **kvci}}}
    req = Request(req_id, list(range(prompt_start, prompt_start + 3 * BS + 1)),
                  SamplingParams(max_tokens=len(output), extra_args=params), None)
    s.get_num_new_matched_tokens(req, 0)
    s.build_connector_meta(Step({req_id: len(req.prompt_token_ids)}))
    req.num_computed_tokens = len(req.prompt_token_ids)
    req.append_output_token_ids(output)
    req.status = RequestStatus.FINISHED_STOPPED
    _, reply = s.request_finished(req, [[10, 11, 12, 13]])
    assert reply is not None
    return reply["kvci"]


class Step:
    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled
        self.total_num_scheduled_tokens = sum(scheduled.values())


def counts(s: KVCIScheduler) -> dict[str, float]:
    stats = s.take_stats()
    return stats.reduce() if stats else {}


def retentions(s: KVCIScheduler) -> int:
    return s.manager.ram_stats()["retentions"]


def test_a_turn_ending_on_a_tool_call_is_retained_until_the_sessions_next_request() -> None:
    s = scheduler()
    reply = turn(s, "r1", [7, MARKER, 7], checkpoint="now")
    assert reply["tool_call"] is True
    assert reply["auto_retain"]["status"] == "retained" and reply["auto_retain"]["ttl_s"] > 0
    assert reply["retain"] is None  # the client asked none
    assert retentions(s) == 1
    seen = counts(s)
    assert seen[c.TOOL_CALLS_DETECTED] == 1 and seen[c.RETENTIONS_AUTOMATIC] == 1

    turn(s, "r2", [7, 7], prompt_start=1)  # the session's next request: the pause ended
    assert retentions(s) == 0
    assert s.decider.return_gaps is not None and s.decider.return_gaps.samples(TOOL_CALL) == 1


def test_a_turn_without_a_marker_is_not_retained() -> None:
    s = scheduler()
    reply = turn(s, "r1", [7, 7, 7], checkpoint="now")
    assert reply["tool_call"] is False and reply["auto_retain"] is None
    assert retentions(s) == 0


def test_the_clients_word_wins_over_the_engines() -> None:
    s = scheduler()
    reply = turn(s, "r1", [7, MARKER], checkpoint="now",
                 observation={"tool_call_pending": False})
    assert reply["tool_call"] is False and reply["auto_retain"] is None
    assert retentions(s) == 0


def test_a_clients_own_retain_replaces_the_automatic_one() -> None:
    s = scheduler()
    reply = turn(s, "r1", [7, MARKER], checkpoint="now", retain={"ttl_s": 5})
    assert reply["retain"]["status"] == "retained" and reply["retain"]["ttl_s"] == 5
    assert reply["auto_retain"] is None
    assert retentions(s) == 1


def test_a_model_without_markers_says_nothing() -> None:
    s = scheduler(markers=find_markers({"hello": 7}))
    reply = turn(s, "r1", [7, MARKER], checkpoint="now")
    assert reply["tool_call"] is None and reply["auto_retain"] is None
    assert retentions(s) == 0
