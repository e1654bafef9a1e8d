"""The simulator's kvci tier (the product's RAM index, policy, advisor and request history) with and
without an engine view: vLLM's own prefix cache in front, the observation in engine tokens."""

from __future__ import annotations

import pytest

from bench.sim_traces import contexts_of, request
from benchmarks.policysim.admission import StoreEverything
from benchmarks.policysim.engine_view import EngineCache, EngineView
from benchmarks.policysim.kvci_tier import KVCITier, page_key, replay_kvci
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.replay import replay
from benchmarks.policysim.sessions import SessionTracker, session_contexts
from benchmarks.policysim.told import told_at_random, told_when_back
from benchmarks.policysim.trace import BLOCK_TOKENS

CHAIN = (1, 2, 3, 4, 5, 6)
VIEW = EngineView(block_tokens=32, cache_blocks=4)


def test_vllms_cache_keeps_a_finished_requests_roots_and_evicts_its_tail_first() -> None:
    cache = EngineCache(VIEW)
    first = request(CHAIN, short_by=10)
    assert cache.lookup(first) == 0
    cache.finished(first)
    assert cache.lookup(request(CHAIN, short_by=10)) == 4  # blocks 5 and 6 were evicted first
    assert cache.lookup(request((1, 2, 9), short_by=10)) == 2
    assert cache.lookup(request((7,), short_by=10)) == 0


def test_engine_tokens_scale_each_full_block_and_round_the_last_up() -> None:
    assert VIEW.prompt_tokens(request(CHAIN, short_by=10)) == 5 * 32 + 32  # 502 / 512 of 32 -> 32
    assert VIEW.prompt_tokens(request(CHAIN, short_by=400)) == 5 * 32 + 7
    assert VIEW.output_tokens(request(CHAIN, output=48)) == 3


def test_with_an_engine_view_kvci_loads_only_what_vllms_cache_does_not_hold() -> None:
    requests = [request(CHAIN, short_by=10, at_ms=0), request(CHAIN, short_by=10, at_ms=1000)]
    tier = KVCITier(100, prefill_tokens_per_second=8192.0, engine=VIEW)
    tally = replay_kvci(requests, contexts_of(requests), tier)
    assert tally.admitted_requests >= 1
    # The repeat: blocks 1-4 from vLLM's cache, 5 from kvci (never every token: 6 is computed).
    assert (tally.engine_saved_tokens, tally.ram_saved_tokens) == (
        4 * BLOCK_TOKENS,
        1 * BLOCK_TOKENS,
    )
    assert tally.saved_tokens == 5 * BLOCK_TOKENS
    # The load is what the request history counts, at the last key it loaded.
    assert tier.history.reuse(page_key(5)) == 1 and tier.history.reuse(page_key(4)) == 0


def test_without_an_engine_view_kvci_serves_the_whole_hit() -> None:
    requests = [request(CHAIN, short_by=10, at_ms=0), request(CHAIN, short_by=10, at_ms=1000)]
    tier = KVCITier(100, prefill_tokens_per_second=8192.0)
    tally = replay_kvci(requests, contexts_of(requests), tier)
    assert (tally.engine_saved_tokens, tally.ram_saved_tokens) == (0, 5 * BLOCK_TOKENS)
    assert tier.history.reuse(page_key(5)) == 1


def test_a_block_tier_behind_vllms_cache_serves_only_past_it() -> None:
    requests = [
        request(CHAIN, short_by=10),
        request(CHAIN, short_by=10),
        request((1, 2, 3, 4, 5, 7), short_by=10),
    ]
    ram = LRUBlockCache(6)
    tally = replay(requests, contexts_of(requests), StoreEverything("lru"), ram, engine=VIEW)
    assert tally.engine_saved_tokens == 8 * BLOCK_TOKENS  # 4 blocks for each repeat
    assert tally.ram_saved_tokens == 2 * BLOCK_TOKENS  # block 5 from RAM, twice
    assert tally.ram_blocks_written == 5  # each last block is partial: never kept


def test_a_churning_session_keeps_only_the_prefix_its_rewrites_kept() -> None:
    """As the connector does (``churn_keeps``): sessions keyed by their first blocks, every turn a
    rewrite past the shared three-block prefix; the third rewrite is paused by the churn rule but
    its prefix is still kept, and no more."""
    requests = [
        request((1, 2, 3, 10 * n, 10 * n + 1), short_by=10, at_ms=1000 * n) for n in range(1, 5)
    ]
    tier = KVCITier(100, prefill_tokens_per_second=8192.0)
    replay_kvci(requests, session_contexts(requests, SessionTracker(threads=False)), tier)
    outcomes = tier.stats()["outcomes"]
    assert (outcomes["kept"], outcomes["cache_gate_kept_prefix"]) == (4, 1)
    assert tier.stats()["gate_refusals"] == {"churn": 1}
    kept = sorted(tuple(entry.keys) for entry in tier.index.entries())
    assert tuple(page_key(b) for b in (1, 2, 3)) in kept
    assert tuple(page_key(b) for b in (1, 2, 3, 40)) not in kept


def test_what_the_clients_say_reaches_the_policy_as_each_requests_class() -> None:
    requests = [request((10 * n + 1, 10 * n + 2), short_by=10, at_ms=1000 * n) for n in range(3)]
    told = [True, None, False]
    tier = KVCITier(100, prefill_tokens_per_second=8192.0, told=told)
    replay_kvci(requests, contexts_of(requests), tier)
    learned = tier.policy.learned(10.0)
    assert len(learned.idle) == 3
    assert sorted((cls[2] for cls in learned.idle.spent()), key=repr) == [False, None, True]
    # A default tier says nothing of any request.
    quiet = KVCITier(100, prefill_tokens_per_second=8192.0)
    replay_kvci(requests, contexts_of(requests), quiet)
    assert {cls[2] for cls in quiet.policy.learned(10.0).idle.spent()} == {None}
    with pytest.raises(IndexError, match="told covers 2 requests; request 3 arrived"):
        replay_kvci(
            requests,
            contexts_of(requests),
            KVCITier(100, prefill_tokens_per_second=8192.0, told=told[:2]),
        )


def test_told_when_back_says_true_of_each_continued_request_and_random_says_as_many_elsewhere() -> (
    None
):
    continued = [True, False, False, True, False, False, False, True]
    assert told_when_back(continued) == [True, None, None, True, None, None, None, True]
    drawn = told_at_random(continued, seed=3)
    assert drawn.count(True) == 3 and drawn.count(None) == 5
    assert drawn == told_at_random(continued, seed=3)
    assert {tuple(told_at_random(continued, seed=s)) for s in range(20)} != {tuple(drawn)}
