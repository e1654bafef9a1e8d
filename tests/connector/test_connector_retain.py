"""Retention an agent asks for (`kvci.retain`), on a real engine with a small RAM tier.

Prefix caching is off, so every hit here comes from kvci's RAM tier. The tests share one engine
and pass in any order: each keeps and looks up under tenants of its own (keys are per tenant), a
flood evicts every checkpoint that is not retained (the tier holds 24 pages; each flood prompt
keeps 4), and the retentions the tests leave behind are few and short, so the flood always has
room.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from engine import (
    BLOCK_SIZE,
    baseline_outputs,
    generate_one,
    greedy,
    kvci_params,
    make_llm,
    shutdown,
)
from server import free_port

from kvci_plugin.api.client import ControlClient

pytestmark = pytest.mark.engine

rng = random.Random(23)
RAM_PAGES = 24  # pages of 16 KiB (see test_connector_ram)
QUOTA_PAGES = 8
MAX_RETAIN_S = 30


def _tokens(n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


PROMPTS = {name: _tokens(4 * BLOCK_SIZE + 5) for name in
           ("retained", "ordinary", "short", "over_bound", "first", "second", "advised")}


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, PROMPTS)


@pytest.fixture(scope="module")
def engine(tiny_model, baseline, tmp_path_factory):
    port = free_port()
    state = tmp_path_factory.mktemp("state")
    llm = make_llm(tiny_model, {
        "ram_bytes": f"{RAM_PAGES * 16}KiB", "tenant_quota_bytes": f"{QUOTA_PAGES * 16}KiB",
        "max_retain_s": MAX_RETAIN_S, "system_trigger": False, "control_port": port,
        "state_dir": str(state)}, disable_log_stats=False)
    _OPERATOR_TOKENS[f"http://127.0.0.1:{port}"] = state / "control-operator.token"
    yield llm, f"http://127.0.0.1:{port}"
    shutdown(llm)


def _reply(llm, prompt: str, **kvci: Any) -> dict[str, Any]:
    return generate_one(llm, PROMPTS[prompt], kvci_params(**kvci)).kv_transfer_params["kvci"]


def _flood(llm) -> None:
    """More distinct pages than the RAM tier holds, each kept under a tenant of its own (the
    quota bounds one tenant's pages)."""
    for i in range(RAM_PAGES // 4 + 2):
        reply = generate_one(llm, _tokens(4 * BLOCK_SIZE + 5),
                             kvci_params(tenant=f"flood-{i}", checkpoint="now")).kv_transfer_params
        assert reply["kvci"]["tier"] == "ram"


def _hit(llm, prompt: str, tenant: str) -> int:
    return _reply(llm, prompt, tenant=tenant, checkpoint="never")["hit_tokens"]


# The operator token the engine at each control URL wrote into its state folder.
_OPERATOR_TOKENS: dict[str, Path] = {}


def _stats(url: str) -> dict[str, Any]:
    with ControlClient(url, token_file=_OPERATOR_TOKENS[url]) as control:
        return control.call({"action": "ram_stats"})["stats"]


def _metrics(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter, Gauge

    values: dict[str, float] = {}
    for m in llm.get_metrics():
        retention = (m.name.startswith("vllm:kvci_retentions")
                     or m.name == "vllm:kvci_ram_retained_bytes")
        if retention and isinstance(m, Counter | Gauge):
            values[m.name] = values.get(m.name, 0.0) + m.value
    return values


def _step(llm) -> None:
    """One step of the engine (a one-token request), as any traffic makes."""
    generate_one(llm, [5, 6, 7], greedy(1))


def test_a_retained_request_survives_a_flood_and_hits(engine, baseline):
    llm, url = engine
    kept = _reply(llm, "retained", tenant="agent", session_id="run-1", retain={"ttl_s": 25})
    assert kept["tier"] == "ram" and kept["trigger"] == "agent"
    assert kept["retain"]["status"] == "retained"
    assert kept["persist"] is None  # retention grants nothing on disk
    ordinary = _reply(llm, "ordinary", tenant="agent-control", checkpoint="now")
    assert ordinary["tier"] == "ram"
    _step(llm)  # the store commits: the retention pins its pages
    stats = _stats(url)
    assert stats["tenant_retained_bytes"].get("agent") == 4 * 16 * 1024
    assert stats["retained_bytes"] >= 4 * 16 * 1024

    _flood(llm)
    assert _hit(llm, "ordinary", "agent-control") == 0  # evicted by the flood
    # The session's next request: it hits the retained KV, and the retention ends.
    back = generate_one(llm, PROMPTS["retained"],
                        kvci_params(tenant="agent", session_id="run-1", checkpoint="never"))
    assert back.kv_transfer_params["kvci"]["hit_tokens"] == 4 * BLOCK_SIZE
    assert list(back.outputs[0].token_ids) == baseline["retained"]
    assert "agent" not in _stats(url)["tenant_retained_bytes"]
    assert _metrics(llm)["vllm:kvci_retentions_released"] >= 1


def test_after_its_ttl_a_retained_request_is_evictable(engine):
    llm, url = engine
    before = _stats(url)["retentions_expired"]
    kept = _reply(llm, "short", tenant="pauser", retain={"ttl_s": 1.5})
    assert kept["retain"]["status"] == "retained"
    _step(llm)
    assert _stats(url)["tenant_retained_bytes"].get("pauser") == 4 * 16 * 1024
    time.sleep(2.0)
    _step(llm)  # a step after the TTL ends the retention
    stats = _stats(url)
    assert stats["retentions_expired"] == before + 1
    assert "pauser" not in stats["tenant_retained_bytes"]
    _flood(llm)
    assert _hit(llm, "short", "pauser") == 0  # it competed like any other checkpoint, and lost
    assert _metrics(llm)["vllm:kvci_retentions_expired"] >= 1


def test_a_ttl_over_the_bound_fails_only_kvci(engine, baseline):
    llm, _ = engine
    out = generate_one(llm, PROMPTS["over_bound"],
                       kvci_params(tenant="greedy", retain={"ttl_s": MAX_RETAIN_S + 1}))
    assert list(out.outputs[0].token_ids) == baseline["over_bound"]  # the request is served
    error = out.kv_transfer_params["kvci"]["error"]
    assert "kvci.retain.ttl_s" in error and f"max_retain_s ({MAX_RETAIN_S} s)" in error
    assert _hit(llm, "over_bound", "greedy") == 0  # nothing kept


def test_a_retention_over_the_tenant_quota_fails_only_kvci(engine, baseline):
    llm, url = engine
    first = _reply(llm, "first", tenant="hoarder", retain={"ttl_s": 20})
    assert first["retain"]["status"] == "retained"
    # 4 pages retained of a quota of 8: 4 more would fit, 4 + 5 would not.
    second = generate_one(llm, PROMPTS["second"] + _tokens(BLOCK_SIZE),
                          kvci_params(tenant="hoarder", retain={"ttl_s": 20}))
    assert len(second.outputs[0].token_ids) == 12  # served
    retain = second.kv_transfer_params["kvci"]["retain"]
    assert retain["status"] == "refused"
    assert "over its quota of 131072 bytes" in retain["reason"]
    _step(llm)
    assert _stats(url)["tenant_retained_bytes"]["hoarder"] == 4 * 16 * 1024
    assert _metrics(llm)["vllm:kvci_retentions_refused"] >= 1


def test_the_advisory_says_when_retention_is_worth_asking_for(engine):
    llm, _ = engine
    pending = {"tool_call_pending": True, "wall_time_s": 3.0, "tool_calls": 2}
    advised = _reply(llm, "advised", tenant="advised", observation=pending)
    assert advised["retain_advice"] and "kvci.retain" in advised["retain_advice"]
    assert f"at most {MAX_RETAIN_S}" in advised["retain_advice"]
    assert advised["retain_advice"] in advised["advisory"]
    cheap = _reply(llm, "advised", tenant="advised",
                   observation={"tool_call_pending": True, "wall_time_s": 0.05})
    assert cheap["retain_advice"] is None
    no_pause = _reply(llm, "advised", tenant="advised", observation={"wall_time_s": 3.0})
    assert no_pause["retain_advice"] is None
