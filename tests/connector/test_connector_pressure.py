"""Hits under chunked prefill and preemption: a small token budget and a small KV cache.

The baseline engine has the same budget and cache, without the connector, so any difference in
greedy output comes from the KV kvci loaded.
"""

from __future__ import annotations

import random

import pytest
from engine import BLOCK_SIZE, greedy, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

# 16 blocks of 32 tokens for 8 requests of ~350 tokens each: vLLM must preempt (8 times here).
PRESSURE = dict(max_num_batched_tokens=64, num_gpu_blocks_override=16, max_num_seqs=8,
                max_model_len=384, disable_log_stats=False)
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
    llm = make_llm(tiny_model, **PRESSURE)
    outs = [list(o.outputs[0].token_ids) for o in _gen(llm, BATCH, greedy(OUT_TOKENS))]
    shutdown(llm)
    return outs


@pytest.fixture(scope="module")
def llm(tiny_model, baseline, tmp_path_factory):
    llm = make_llm(tiny_model, {"ram_bytes": "16MiB", "state_dir": str(tmp_path_factory.mktemp("s")),
                                "system_trigger": False}, **PRESSURE)
    yield llm
    shutdown(llm)


def test_chunked_prefill_store_then_hit_under_preemption(llm, baseline):
    # Stored after a prefill that took several chunks of 64 tokens.
    (first,) = _gen(llm, [BATCH[0]], kvci_params(tenant="t", checkpoint="now"))
    assert first.kv_transfer_params["kvci"]["tier"] == "ram"
    assert list(first.outputs[0].token_ids) == baseline[0][:12]

    before = _preemptions(llm)
    outs = _gen(llm, BATCH, greedy(OUT_TOKENS, kv_transfer_params={"kvci": {"tenant": "t"}}))
    assert _preemptions(llm) > before  # the small cache forced preemptions
    assert sum(o.kv_transfer_params["kvci"]["hit_tokens"] >= 4 * BLOCK_SIZE for o in outs) >= 4
    assert [list(o.outputs[0].token_ids) for o in outs] == baseline
