"""Retention orders in vLLM's KV hints, and what the surfaces say of every retention (#49), on the
scheduler side (no engine: real vLLM Requests carrying a real `KvHintsEnvelope`, the real
scheduler, keep decision and RAM tier).

A `kvci.retain` action is an order carried out as a client's `kvci.retain` is: granted with its
TTL, trimmed to `max_retain_s`, refused past the tenant's share, and ignored (a debug line, never
a failed request) when malformed. The client's word wins over the hint's, and both over the
engine's automatic retention. `explain` says whether the turn ended on a tool call and what was
retained, how long, by whose word; `/metrics` counts the automatic retentions the session's next
request loaded and those whose TTL ended unused."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from support.scheduler_turns import Step, run_turn
from vllm import SamplingParams
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.request import Request

from kvci_plugin.api.schema import CheckpointExplanation
from kvci_plugin.connector import counters as c
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.request.tool_calls import find_markers

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"kv-hints").digest()
MARKER = 500
MARKERS = find_markers({"<tool_call>": MARKER, "hello": 7})


def scheduler(ram_slots: int = 64, **config: Any) -> KVCIScheduler:
    return KVCIScheduler(
        config=KVCIConfig(ram_bytes=ram_slots * SLOT, ram_policy="lru", **config),
        block_size=BS, slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
        tenants=TenantResolver(None), disk=None, markers=MARKERS)


def envelope(*actions: tuple[str, str, dict[str, Any]]) -> KvHintsEnvelope:
    """vLLM's envelope of (action_type, action_version, payload) actions."""
    return KvHintsEnvelope(protocol_version="1", message_id="m-1", actions=[
        KvHintAction(action_id=f"a-{i}", action_type=t, action_version=v, payload=p)
        for i, (t, v, p) in enumerate(actions)])


def retain(ttl_s: Any, **more: Any) -> tuple[str, str, dict[str, Any]]:
    return ("kvci.retain", "1", {"ttl_s": ttl_s, **more})


def request(req_id: str, *, prompt_start: int = 1, hints: KvHintsEnvelope | None = None,
            bare: bool = False, **kvci: Any) -> Request:
    """A request of session s-1, 3 full blocks and a token; ``kvci`` more of its client's params
    (``bare``: its client sends no `kvci` at all)."""
    extra = {"kv_transfer_params": {"kvci": {"tenant": "acme", "session_id": "s-1", **kvci}}}
    return Request(req_id, list(range(prompt_start, prompt_start + 3 * BS + 1)),
                   SamplingParams(max_tokens=2, extra_args=None if bare else extra), None,
                   kv_hints=hints)


def turn(s: KVCIScheduler, req: Request, output: list[int]) -> dict[str, Any] | None:
    """``req`` looked up (its hit loaded), run and finished with ``output``: its reply's kvci."""
    return run_turn(s, req, output)[1]


def counts(s: KVCIScheduler) -> dict[str, float]:
    stats = s.take_stats()
    return stats.reduce() if stats else {}


def retentions(s: KVCIScheduler) -> int:
    return s.manager.ram_stats()["retentions"]


# ---- a kv_hints retention order -----------------------------------------------------------------

def test_a_hint_retention_is_granted_with_its_ttl() -> None:
    s = scheduler()
    reply = turn(s, request("r1", hints=envelope(retain(30, priority=7)), trigger="agent"), [7])
    assert reply is not None and reply.get("error") is None
    assert reply["retain"] == {"status": "retained", "ttl_s": 30.0, "by": "kv_hints",
                               "priority": 7, "reason": reply["retain"]["reason"],
                               "session": {"id": "s-1", "by": "client"}}
    assert reply["trigger"] == "agent" and reply["tier"] == "ram"
    assert retentions(s) == 1
    seen = counts(s)
    assert seen[c.RETENTIONS_RETAINED] == 1 and seen[c.RETENTIONS_KV_HINTS] == 1


def test_a_hint_retains_a_request_whose_client_sent_no_kvci_params() -> None:
    s = scheduler()
    reply = turn(s, request("r1", hints=envelope(retain(12)), bare=True), [7])
    assert reply is not None and reply["retain"]["status"] == "retained"
    assert reply["retain"]["ttl_s"] == 12.0 and reply["retain"]["by"] == "kv_hints"
    assert retentions(s) == 1


def test_the_highest_priority_of_an_envelopes_retentions_is_taken() -> None:
    s = scheduler()
    hints = envelope(retain(10, priority=1), retain(20, priority=9), retain(30, priority=9))
    reply = turn(s, request("r1", hints=hints, trigger="agent"), [7])
    assert reply is not None
    assert reply["retain"]["ttl_s"] == 20.0 and reply["retain"]["priority"] == 9


def test_a_hint_ttl_is_trimmed_to_max_retain_s() -> None:
    s = scheduler(max_retain_s=60.0)
    reply = turn(s, request("r1", hints=envelope(retain(1000.0)), trigger="agent"), [7])
    assert reply is not None and reply.get("error") is None  # a hint never fails the request
    assert reply["retain"]["status"] == "retained"
    assert reply["retain"]["ttl_s"] == 60.0 and reply["retain"]["asked_ttl_s"] == 1000.0


def test_an_engine_granting_no_retention_ignores_the_hint() -> None:
    s = scheduler(max_retain_s=0.0)
    reply = turn(s, request("r1", hints=envelope(retain(10)), trigger="agent"), [7])
    assert reply is not None and reply.get("error") is None and reply["retain"] is None
    assert retentions(s) == 0


def test_a_hint_retention_past_the_tenants_share_is_refused() -> None:
    # The first request's 3 retained pages fit the tenant's 4, 3 more would not.
    s = scheduler(tenant_quota_bytes=4 * SLOT)
    first = turn(s, request("r1", hints=envelope(retain(60)), trigger="agent"), [7])
    assert first is not None and first["retain"]["status"] == "retained"
    second = turn(s, request("r2", prompt_start=1000, hints=envelope(retain(60)),
                             trigger="agent", session_id="s-2"), [7])
    assert second is not None and second.get("error") is None
    assert second["retain"]["status"] == "refused" and second["retain"]["by"] == "kv_hints"
    assert "over its quota" in second["retain"]["reason"]
    assert retentions(s) == 1
    assert counts(s)[c.RETENTIONS_REFUSED] == 1


def test_a_malformed_hint_is_ignored_with_a_debug_line(caplog: Any) -> None:
    s = scheduler()
    bad = envelope(retain("soon"), retain(-1), retain(float("inf")), retain(5, extra=1),
                   ("kvci.retain", "2", {"ttl_s": 5}), retain(5, priority=1000))
    with caplog.at_level(logging.DEBUG, logger="kvci_plugin"):
        reply = turn(s, request("r1", hints=bad, trigger="agent"), [7])
    assert reply is not None and reply.get("error") is None and reply["retain"] is None
    assert retentions(s) == 0
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "bad payload" in logged and "version '2' unknown" in logged


def test_a_malformed_hint_on_a_request_without_kvci_params_changes_nothing() -> None:
    s = scheduler()
    assert turn(s, request("r1", hints=envelope(retain(None)), bare=True), [7]) is None
    assert retentions(s) == 0


# ---- whose word wins ----------------------------------------------------------------------------

def test_a_hint_wins_over_the_engines_automatic_retention() -> None:
    s = scheduler()
    reply = turn(s, request("r1", hints=envelope(retain(7)), checkpoint="now"), [7, MARKER])
    assert reply is not None and reply["tool_call"] is True
    assert reply["retain"]["ttl_s"] == 7.0 and reply["retain"]["by"] == "kv_hints"
    assert reply["auto_retain"] is None
    assert retentions(s) == 1
    seen = counts(s)
    assert seen[c.TOOL_CALLS_DETECTED] == 1 and c.RETENTIONS_AUTOMATIC not in seen


def test_the_clients_retain_wins_over_a_hint() -> None:
    s = scheduler()
    reply = turn(s, request("r1", hints=envelope(retain(7)), retain={"ttl_s": 5}), [7, MARKER])
    assert reply is not None
    assert reply["retain"] == {"status": "retained", "ttl_s": 5.0, "by": "client",
                               "reason": reply["retain"]["reason"],
                               "session": {"id": "s-1", "by": "client"}}
    assert reply["auto_retain"] is None
    assert counts(s).get(c.RETENTIONS_KV_HINTS) is None


def test_the_clients_never_wins_over_a_hint() -> None:
    s = scheduler()
    reply = turn(s, request("r1", hints=envelope(retain(7)), checkpoint="never"), [7, MARKER])
    assert reply is not None and reply.get("error") is None
    assert reply["retain"] is None and reply["tier"] == "none"
    assert retentions(s) == 0


# ---- explain ------------------------------------------------------------------------------------

def explain(s: KVCIScheduler, reply: dict[str, Any] | None) -> CheckpointExplanation:
    assert reply is not None and reply["checkpoint_id"] is not None
    # As the control surface reads it (api.control): through JSON.
    raw = s.manager.explain(reply["checkpoint_id"])
    return CheckpointExplanation.model_validate_json(json.dumps(raw))


def test_explain_says_the_engines_tool_call_and_its_automatic_retention() -> None:
    s = scheduler()
    seen = explain(s, turn(s, request("r1", checkpoint="now"), [7, MARKER]))
    assert seen.tool_call is not None
    assert seen.tool_call.detected is True and seen.tool_call.pending is True
    assert seen.retention is not None
    assert seen.retention.by == "engine" and seen.retention.status == "retained"
    assert seen.retention.ttl_s > 0


def test_explain_says_a_hints_retention_and_a_turn_without_a_tool_call() -> None:
    s = scheduler(max_retain_s=60.0)
    seen = explain(s, turn(s, request("r1", hints=envelope(retain(90, priority=3)),
                                      trigger="agent"), [7, 7]))
    assert seen.tool_call is not None and seen.tool_call.detected is False
    assert seen.retention is not None and seen.retention.by == "kv_hints"
    assert (seen.retention.ttl_s, seen.retention.asked_ttl_s, seen.retention.priority) == (
        60.0, 90.0, 3)


def test_explain_says_the_clients_retention_and_the_clients_word_on_the_tool_call() -> None:
    s = scheduler()
    reply = turn(s, request("r1", retain={"ttl_s": 5},
                            observation={"tool_call_pending": True}), [7])
    seen = explain(s, reply)
    assert seen.tool_call is not None
    assert seen.tool_call.detected is False and seen.tool_call.pending is True
    assert seen.retention is not None and seen.retention.by == "client"
    assert seen.retention.ttl_s == 5.0


def test_explain_of_a_checkpoint_nobody_retained_says_no_retention() -> None:
    s = scheduler()
    seen = explain(s, turn(s, request("r1", checkpoint="now"), [7]))
    assert seen.retention is None
    assert seen.tool_call is not None and seen.tool_call.detected is False


# ---- /metrics: what became of the automatic retentions ------------------------------------------

def test_an_automatic_retention_the_sessions_next_request_loads_is_a_hit() -> None:
    s = scheduler()
    first = turn(s, request("r1", checkpoint="now"), [7, MARKER])
    assert first is not None and first["auto_retain"]["status"] == "retained"
    counts(s)
    again = turn(s, request("r2"), [7])  # the tool's result: the session's next request
    assert again is not None and again["hit_tokens"] == 3 * BS and again["hit_tier"] == "ram"
    assert retentions(s) == 0
    seen = counts(s)
    assert seen[c.RETENTIONS_AUTOMATIC_HITS] == 1
    assert c.RETENTIONS_AUTOMATIC_EXPIRED not in seen


def test_a_return_that_loads_nothing_retained_is_no_hit() -> None:
    s = scheduler()
    turn(s, request("r1", checkpoint="now"), [7, MARKER])
    counts(s)
    turn(s, request("r2", prompt_start=2000), [7])  # same session, another context
    assert retentions(s) == 0
    assert c.RETENTIONS_AUTOMATIC_HITS not in counts(s)


def test_an_automatic_retention_whose_ttl_ends_unused_is_an_expiry() -> None:
    s = scheduler(max_retain_s=0.05)  # the learned TTL is at most this
    first = turn(s, request("r1", checkpoint="now"), [7, MARKER])
    assert first is not None and first["auto_retain"]["status"] == "retained"
    assert retentions(s) == 1
    time.sleep(0.1)
    s.build_connector_meta(Step({}))  # a step: the retentions whose TTL ended end
    assert retentions(s) == 0
    seen = counts(s)
    assert seen[c.RETENTIONS_AUTOMATIC_EXPIRED] == 1 and seen[c.RETENTIONS_EXPIRED] == 1
    assert c.RETENTIONS_AUTOMATIC_HITS not in seen


def test_a_hint_retention_is_neither_an_automatic_hit_nor_expiry() -> None:
    s = scheduler(max_retain_s=0.05)
    turn(s, request("r1", hints=envelope(retain(0.01)), checkpoint="now"), [7, MARKER])
    time.sleep(0.05)
    s.build_connector_meta(Step({}))
    seen = counts(s)
    assert seen[c.RETENTIONS_EXPIRED] == 1 and c.RETENTIONS_AUTOMATIC_EXPIRED not in seen
