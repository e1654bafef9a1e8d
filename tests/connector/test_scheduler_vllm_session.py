"""vLLM's own session id standing in for ``kvci.session_id`` (#49), on the scheduler side (no
engine: real vLLM Requests, the real scheduler, keep decision and RAM tier).

vLLM 0.34's OpenAI server fills ``Request.session_id`` from the body's ``session_id``, the
``X-Session-ID`` header or ``vllm_xargs``; a client that names its session that way, and sends no
``kvci`` object at all, gets the automatic retention of a turn that ended on a tool call, ended
by its session's next request. The client's own ``kvci.session_id`` wins; either way the session
is the tenant's own; an id kvci's pattern does not admit is kept as its digest. On a vLLM without
``Request.session_id`` (0.32, 0.33) the attribute is set as 0.34's constructor sets it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from support.scheduler_turns import run_turn
from vllm import SamplingParams
from vllm.v1.request import Request

from kvci_plugin.api.schema import CheckpointExplanation
from kvci_plugin.connector import counters as c
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.session import DIGEST_PREFIX, admitted_session_id, request_session
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.request.tool_calls import find_markers

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"vllm-session").digest()
MARKER = 500
MARKERS = find_markers({"<tool_call>": MARKER, "hello": 7})
TAKES_SESSION_ID = "session_id" in inspect.signature(Request.__init__).parameters


def scheduler(**config: Any) -> KVCIScheduler:
    return KVCIScheduler(
        config=KVCIConfig(ram_bytes=64 * SLOT, ram_policy="lru", **config),
        block_size=BS, slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
        tenants=TenantResolver(None), disk=None, markers=MARKERS)


def request(req_id: str, vllm_session: str | None, *, prompt_start: int = 1,
            **kvci: Any) -> Request:
    """A request of 3 full blocks and a token that vLLM knows as of ``vllm_session``; ``kvci``:
    its client's params (none: it sends no `kvci` object)."""
    extra = {"kv_transfer_params": {"kvci": kvci}} if kvci else None
    prompt = list(range(prompt_start, prompt_start + 3 * BS + 1))
    params = SamplingParams(max_tokens=2, extra_args=extra)
    if TAKES_SESSION_ID:
        return Request(req_id, prompt, params, None, session_id=vllm_session)
    req = Request(req_id, prompt, params, None)
    req.session_id = vllm_session  # as 0.34's constructor sets it
    return req


def retentions(s: KVCIScheduler) -> int:
    return s.manager.ram_stats()["retentions"]


def counts(s: KVCIScheduler) -> dict[str, float]:
    stats = s.take_stats()
    return stats.reduce() if stats else {}


def only_checkpoint(s: KVCIScheduler) -> CheckpointExplanation:
    (entry,) = s.manager.index.entries()
    cid = entry.checkpoint_id
    return CheckpointExplanation.model_validate_json(json.dumps(s.manager.explain(cid)))


# ---- a client that sends no kvci object ---------------------------------------------------------

def test_a_tool_call_turn_of_a_vllm_session_is_retained_and_its_next_request_ends_it() -> None:
    s = scheduler()
    _, reply = run_turn(s, request("r1", "run-42"), [7, MARKER])
    assert reply is None  # nothing asked, nothing said
    assert retentions(s) == 1
    seen = only_checkpoint(s).retention
    assert seen is not None and seen.by == "engine" and seen.status == "retained"
    assert (seen.session.id, seen.session.by) == ("run-42", "vllm")
    assert counts(s)[c.RETENTIONS_AUTOMATIC] == 1
    hit, _ = run_turn(s, request("r2", "run-42"), [7])  # the tool's result
    assert hit == 3 * BS
    assert retentions(s) == 0
    assert counts(s)[c.RETENTIONS_AUTOMATIC_HITS] == 1


def test_without_a_session_id_nothing_is_retained() -> None:
    s = scheduler()
    run_turn(s, request("r1", None), [7, MARKER])
    assert retentions(s) == 0
    assert c.RETENTIONS_AUTOMATIC not in counts(s)


def test_another_sessions_request_leaves_the_retention() -> None:
    s = scheduler()
    run_turn(s, request("r1", "run-42"), [7, MARKER])
    run_turn(s, request("r2", "run-7", prompt_start=2000), [7])
    assert retentions(s) == 1


def test_another_tenants_request_naming_the_same_session_leaves_the_retention() -> None:
    s = scheduler()
    run_turn(s, request("r1", "run-42", tenant="acme"), [7, MARKER])
    assert retentions(s) == 1
    run_turn(s, request("r2", "run-42", prompt_start=2000, tenant="globex"), [7])
    assert retentions(s) == 1
    run_turn(s, request("r3", "run-42", prompt_start=4000, tenant="acme"), [7])
    assert retentions(s) == 0


# ---- whose word wins ----------------------------------------------------------------------------

def test_the_clients_kvci_session_id_wins_over_vllms() -> None:
    s = scheduler()
    run_turn(s, request("r1", "vllm-side", session_id="client-side", checkpoint="now"), [7, MARKER])
    seen = only_checkpoint(s).retention
    assert seen is not None and (seen.session.id, seen.session.by) == ("client-side", "client")
    run_turn(s, request("r2", "vllm-side", prompt_start=2000), [7])
    assert retentions(s) == 1  # vLLM's id is not the session
    run_turn(s, request("r3", "client-side", prompt_start=4000), [7])
    assert retentions(s) == 0  # the same id, named by vLLM this time: the same session


def test_a_client_retain_keys_on_vllms_session_and_says_so() -> None:
    s = scheduler()
    _, reply = run_turn(s, request("r1", "run-42", retain={"ttl_s": 60}), [7])
    assert reply is not None
    assert reply["retain"]["session"] == {"id": "run-42", "by": "vllm"}
    run_turn(s, request("r2", "run-42", prompt_start=2000), [7])
    assert retentions(s) == 0


def test_malformed_kvci_params_take_no_session() -> None:
    """Bad input fails only the request's kvci handling: it neither keeps nor ends anything."""
    s = scheduler()
    run_turn(s, request("r1", "run-42"), [7, MARKER])
    _, reply = run_turn(s, request("r2", "run-42", prompt_start=2000, bogus=1), [7])
    assert reply is not None and reply["error"]
    assert retentions(s) == 1


# ---- an id kvci's pattern does not admit --------------------------------------------------------

def test_a_free_text_session_id_is_one_session_by_its_digest() -> None:
    s = scheduler()
    name = "conversation #42 (Ana's laptop)"
    run_turn(s, request("r1", name), [7, MARKER])
    seen = only_checkpoint(s).retention
    assert seen is not None and seen.session is not None
    assert seen.session.id.startswith(DIGEST_PREFIX) and seen.session.by == "vllm"
    run_turn(s, request("r2", name + " ", prompt_start=2000), [7])
    assert retentions(s) == 1  # another text, another session
    run_turn(s, request("r3", name, prompt_start=4000), [7])
    assert retentions(s) == 0


def test_admitted_session_ids() -> None:
    assert admitted_session_id("run-42") == "run-42"
    assert admitted_session_id("a" * 128) == "a" * 128
    for odd in ("a" * 129, "run 42", "run-42\n", "é", "\ud800"):
        got = admitted_session_id(odd)
        assert got.startswith(DIGEST_PREFIX) and len(got) == len(DIGEST_PREFIX) + 32
        assert got == admitted_session_id(odd)
    assert admitted_session_id("run 42") != admitted_session_id("run 43")


def test_request_session_reads_only_a_nonempty_text() -> None:
    class Bare:
        pass

    for value in (None, "", 42, b"run-42"):
        r = Bare()
        r.session_id = value  # type: ignore[attr-defined]
        assert request_session(None, r) is None
    assert request_session(None, Bare()) is None  # a vLLM without Request.session_id
