"""Hits under chunked prefill (a 64-token budget) and under preemption (a 16-block KV cache).

The baseline engine has the same budget without the connector and a cache large enough to
never preempt; vLLM alone gives the same greedy output with and without preemption here, so any
difference comes from the KV kvci loaded. Both run in float32: a preempted request recomputes its
generated tokens' KV in a prefill instead of decode steps, and with loads shifting where the
preemptions land, bf16 rounding flipped a near-tied greedy choice of this random-weight model
(one request of eight, at its 2nd token) while float32 agrees token for token.
"""

from __future__ import annotations

import random

import pytest
from engine import BLOCK_SIZE, generate_one, greedy, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

CHUNKED = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=384, dtype="float32",
               disable_log_stats=False)
rng = random.Random(5)
SHARED = [rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE)]
BATCH = [SHARED + [rng.randrange(2, 1000) for _ in range(20)] for _ in range(8)]
OUT_TOKENS = 200


def _gen(llm, prompts, sp):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")  # a Counter


@pytest.fixture(scope="module")
def baseline(tiny_model):
    llm = make_llm(tiny_model, num_gpu_blocks_override=128, **CHUNKED)
    outs = [list(o.outputs[0].token_ids) for o in _gen(llm, BATCH, greedy(OUT_TOKENS))]
    shutdown(llm)
    return outs


def _store_then_batch(tiny_model, tmp_path_factory, blocks):
    llm = make_llm(tiny_model, {"ram_bytes": "16MiB", "system_trigger": False,
                                "state_dir": str(tmp_path_factory.mktemp("s"))},
                   num_gpu_blocks_override=blocks, **CHUNKED)
    try:
        first = generate_one(llm, BATCH[0], kvci_params(tenant="t", checkpoint="now"))
        assert first.kv_transfer_params["kvci"]["tier"] == "ram"
        before = _preemptions(llm)
        outs = _gen(llm, BATCH, greedy(OUT_TOKENS, kv_transfer_params={"kvci": {"tenant": "t"}}))
        return first, outs, _preemptions(llm) - before
    finally:
        shutdown(llm)


def test_hits_with_chunked_prefill_equal_baseline(tiny_model, baseline, tmp_path_factory):
    first, outs, preempted = _store_then_batch(tiny_model, tmp_path_factory, blocks=128)
    assert list(first.outputs[0].token_ids) == baseline[0][:12]  # stored after 3 prefill chunks
    assert preempted == 0
    assert all(o.kv_transfer_params["kvci"]["hit_tokens"] == 4 * BLOCK_SIZE for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == baseline


def test_hits_under_preemption_equal_baseline(tiny_model, baseline, tmp_path_factory):
    _, outs, preempted = _store_then_batch(tiny_model, tmp_path_factory, blocks=16)
    assert preempted > 0  # 8 requests of ~350 tokens in 16 blocks of 32
    assert sum(o.kv_transfer_params["kvci"]["hit_tokens"] == 4 * BLOCK_SIZE for o in outs) >= 4
    assert [list(o.outputs[0].token_ids) for o in outs] == baseline
