"""A retention order in vLLM's KV hints (#49), on a real engine: the `KvHintsEnvelope` handed to
`add_request` reaches the connector on `Request.kv_hints` (through the engine core's request
serialisation), and its `kvci.retain` action retains the request's KV through a flood as a
client's `retain` does; a malformed one is ignored and the request served.

Prefix caching is off, so every hit comes from kvci's RAM tier (24 pages; a flood prompt keeps 4).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from engine import BLOCK_SIZE, generate_one, greedy, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

rng = random.Random(49)
RAM_PAGES = 24  # pages of 16 KiB (see test_connector_ram)
QUOTA_PAGES = 8
_ids = itertools.count()


def _tokens(n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = make_llm(tiny_model, {
        "ram_bytes": f"{RAM_PAGES * 16}KiB", "tenant_quota_bytes": f"{QUOTA_PAGES * 16}KiB",
        "max_retain_s": 30, "system_trigger": False}, disable_log_stats=False)
    yield llm
    shutdown(llm)


def _envelope(*payloads: Any, version: str = "1") -> Any:
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope(protocol_version="1", message_id=f"m-{next(_ids)}", actions=[
        KvHintAction(action_id=f"a-{i}", action_type="kvci.retain", action_version=version,
                     payload=p) for i, p in enumerate(payloads)])


def _generate_hinted(llm: Any, tokens: list[int], sp: Any, hints: Any) -> Any:
    """One request with KV hints, through the engine's add_request; its finished output."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request(f"hinted-{next(_ids)}", TokensPrompt(prompt_token_ids=tokens), sp,
                       kv_hints=hints)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(out for out in engine.step() if out.finished)
    (out,) = finished
    return out


def _flood(llm: Any) -> None:
    """More distinct pages than the RAM tier holds, each kept under a tenant of its own."""
    for i in range(RAM_PAGES // 4 + 2):
        reply = generate_one(llm, _tokens(4 * BLOCK_SIZE + 5),
                             kvci_params(tenant=f"flood-{i}", checkpoint="now")).kv_transfer_params
        assert reply["kvci"]["tier"] == "ram"


def _hit(llm: Any, tokens: list[int], tenant: str) -> int:
    out = generate_one(llm, tokens, kvci_params(tenant=tenant, checkpoint="never"))
    return out.kv_transfer_params["kvci"]["hit_tokens"]


def _metric(llm: Any, name: str) -> float:
    from vllm.v1.metrics.reader import Counter

    return sum(m.value for m in llm.get_metrics() if m.name == name and isinstance(m, Counter))


def test_a_hinted_retention_survives_a_flood_and_hits(llm):
    prompt = _tokens(4 * BLOCK_SIZE + 5)
    out = _generate_hinted(llm, prompt, kvci_params(tenant="agent", session_id="run-1"),
                           _envelope({"ttl_s": 25, "priority": 4}))
    reply = out.kv_transfer_params["kvci"]
    assert reply["retain"]["status"] == "retained" and reply["retain"]["by"] == "kv_hints"
    assert reply["retain"]["ttl_s"] == 25.0 and reply["retain"]["priority"] == 4
    assert reply["tier"] == "ram"
    _flood(llm)
    assert _hit(llm, prompt, "agent") == 4 * BLOCK_SIZE
    assert _metric(llm, "vllm:kvci_retentions_kv_hints") >= 1


def test_a_hint_alone_retains_and_is_told(llm):
    prompt = _tokens(4 * BLOCK_SIZE + 5)
    out = _generate_hinted(llm, prompt, greedy(), _envelope({"ttl_s": 60}))
    retain = out.kv_transfer_params["kvci"]["retain"]
    assert retain["status"] == "retained" and retain["ttl_s"] == 30.0  # trimmed to max_retain_s
    assert retain["asked_ttl_s"] == 60.0


def test_a_malformed_hint_is_ignored_and_the_request_served(llm):
    prompt = _tokens(4 * BLOCK_SIZE + 5)
    out = _generate_hinted(llm, prompt, kvci_params(tenant="bad-hint"),
                           _envelope({"ttl_s": "soon"}, {"ttl_s": 5, "pin": True}))
    reply = out.kv_transfer_params["kvci"]
    assert reply.get("error") is None and reply["retain"] is None
    assert len(out.outputs[0].token_ids) == 12
