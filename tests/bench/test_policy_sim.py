"""The admission-policy simulator: its caches, session view, policies, replay, CLI and README."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvci_plugin
from bench.sim_traces import chains, contexts_of, request
from benchmarks.policysim.admission import Admission, StoreEverything
from benchmarks.policysim.arc_cache import ARCBlockCache
from benchmarks.policysim.belady_bound import BeladyBound
from benchmarks.policysim.follow_up import FollowUpRate, follow_up_table
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.model_shape import model_shape
from benchmarks.policysim.offer_threshold import StoreAfterNOffers
from benchmarks.policysim.oracle_admission import ContinuationOracle, continued_later
from benchmarks.policysim.random_admission import RandomAdmission
from benchmarks.policysim.replay import Tally, replay
from benchmarks.policysim.report import (
    BudgetRun,
    PolicyResult,
    Role,
    SimulationReport,
    budget_run,
    target_for,
)
from benchmarks.policysim.s3fifo_cache import S3FIFOBlockCache
from benchmarks.policysim.sessions import RequestContext, SessionTracker, extends
from benchmarks.policysim.tinylfu_cache import WTinyLFUBlockCache
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest, load_trace
from benchmarks.policysim.worthiness_admission import WorthinessAdmission
from kvci_plugin.policy.admission import PressureAwareAdmission
from kvci_plugin.worthiness import CheckpointAdvisor, CheckpointObservation

REPO_ROOT = Path(kvci_plugin.__file__).resolve().parents[1]


def write_trace(path: Path, requests: Sequence[TraceRequest]) -> Path:
    rows = (
        {
            "timestamp": r.timestamp_ms,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
        }
        for r in requests
    )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# --- trace and model shape -------------------------------------------------------------------


def test_llama_3_8b_costs_128_kib_per_token() -> None:
    assert model_shape("llama-3-8b-bf16").bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    with pytest.raises(ValueError, match="unknown model shape 'gpt-9'"):
        model_shape("gpt-9")


def test_load_trace_reads_lines_and_honours_limit(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl", [request([0, 1], at_ms=0), request([0, 1, 2], at_ms=5)]
    )
    assert load_trace(path) == [request([0, 1], at_ms=0), request([0, 1, 2], at_ms=5)]
    assert load_trace(path, limit=1) == [request([0, 1], at_ms=0)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"t.jsonl:2: not JSON"),
        (
            '{"timestamp": 9, "input_length": 600, "output_length": 1}',
            r"t.jsonl:2: hash_ids must be a list",
        ),
        (
            '{"timestamp": 9, "input_length": -1, "output_length": 1, "hash_ids": []}',
            r"t.jsonl:2: input_length",
        ),
        (
            '{"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [0]}',
            r"1 hash_ids for input_length 600",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
            r"timestamp 1 goes back in time",
        ),
    ],
)
def test_load_trace_names_the_line_and_field_it_rejects(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n' + line + "\n"
    )
    with pytest.raises(ValueError, match=message):
        load_trace(path)


# --- caches ----------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_block() -> None:
    cache = LRUBlockCache(2)
    cache.insert(1)
    cache.insert(2)
    cache.touch(1)
    cache.insert(3)
    assert 2 not in cache and 1 in cache and 3 in cache and len(cache) == 2
    with pytest.raises(ValueError, match="already resident"):
        cache.insert(1)
    with pytest.raises(ValueError, match="capacity"):
        LRUBlockCache(0)


def test_arc_keeps_blocks_used_twice_through_a_scan_that_flushes_lru() -> None:
    arc, lru = ARCBlockCache(4), LRUBlockCache(4)
    for cache in (arc, lru):
        for block in ("hot-1", "hot-2"):
            cache.insert(hash(block))
            cache.touch(hash(block))
        for block in range(100, 110):
            cache.insert(block)
    assert hash("hot-1") in arc and hash("hot-2") in arc
    assert hash("hot-1") not in lru and hash("hot-2") not in lru


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 6), accesses=st.lists(st.integers(0, 15), max_size=200))
def test_arc_lists_stay_within_their_bounds(capacity: int, accesses: list[int]) -> None:
    cache = ARCBlockCache(capacity)
    for block in accesses:
        if block in cache:
            cache.touch(block)
        else:
            cache.insert(block)
        assert block in cache
        lists = (set(cache.t1), set(cache.t2), set(cache.b1), set(cache.b2))
        assert sum(map(len, lists)) == len(set().union(*lists)), "a block sits in two lists"
        assert len(cache) <= capacity
        assert len(cache.t1) + len(cache.b1) <= capacity
        assert sum(map(len, lists)) <= 2 * capacity
        assert 0.0 <= cache.target_t1 <= capacity


# --- sessions ----------------------------------------------------------------------------------


def test_sessions_count_turns_rewrites_and_earlier_requests() -> None:
    tracker = SessionTracker(key_blocks=2, rewrite_window_s=10.0)
    first = tracker.observe(request([0, 5, 6], at_ms=0))
    extended = tracker.observe(
        request([0, 5, 6, 7, 8], at_ms=1_000)
    )  # re-sends 0, 5 (6 was partial)
    rewritten = tracker.observe(request([0, 5, 9], at_ms=2_000))  # drops 6, 7: a rewrite
    again = tracker.observe(request([0, 5, 9, 10], at_ms=3_000))
    late = tracker.observe(request([0, 5, 11], at_ms=20_000))  # the earlier rewrite left the window
    other = tracker.observe(request([0, 1], at_ms=20_000))
    lone = tracker.observe(request([0], at_ms=20_000))
    # The last field: blocks the session's previous prompt did not hold (all of a first prompt's).
    assert first == RequestContext("0-5", 0, 0, 0, False, 3)
    assert extended == RequestContext("0-5", 1, 1, 0, False, 2)
    assert rewritten == RequestContext("0-5", 2, 0, 1, True, 1)  # 9 replaces 6: new from there on
    assert again == RequestContext("0-5", 3, 1, 1, False, 1)
    assert late == RequestContext("0-5", 4, 0, 1, True, 1)
    assert other == RequestContext("0-1", 0, 0, 0, False, 2)
    assert lone == RequestContext(None, 0, 0, 0, False, None)


def test_the_session_table_forgets_the_least_recently_active_session() -> None:
    tracker = SessionTracker(max_sessions=2)
    for chain in ([0, 1], [0, 2], [0, 1, 3], [0, 4]):
        tracker.observe(request(chain))
    assert tracker.observe(request([0, 1, 3, 5])).observed_reuse == 2
    assert tracker.observe(request([0, 2, 6])).observed_reuse == 0  # forgotten: a new session


def test_extends_allows_only_the_last_block_to_differ() -> None:
    assert extends((0, 1, 2), (0, 1, 9, 10))
    assert extends((0, 1, 2), (0, 1))
    assert not extends((0, 1, 2), (0, 3, 4))
    assert not extends((0, 1, 2), (0,))


# --- admission policies ---------------------------------------------------------------------


def test_store_after_n_admits_a_block_at_its_nth_offer() -> None:
    policy = StoreAfterNOffers(2)
    no_context = RequestContext(None, 0, 0, 0, False, None)
    assert policy.admit(request([0, 1, 2]), no_context, 0).ram_blocks == 0
    assert policy.admit(request([0, 1, 3]), no_context, 0).ram_blocks == 2  # 0 and 1 seen twice
    assert policy.admit(request([0, 1, 3, 4]), no_context, 0).ram_blocks == 3
    assert policy.admit(request([0, 5]), no_context, 0).ram_blocks == 1


def test_random_admission_follows_its_rate_and_seed() -> None:
    trace = [request([0, i]) for i in range(1, 2001)]
    contexts = contexts_of(trace)

    def admitted(seed: int) -> list[bool]:
        policy = RandomAdmission(0.25, seed=seed)
        return [policy.admit(r, c, 0).ram_blocks > 0 for r, c in zip(trace, contexts)]

    assert admitted(7) == admitted(7) != admitted(8)
    assert 0.2 < sum(admitted(7)) / len(trace) < 0.3


def test_the_oracle_admits_exactly_the_requests_whose_session_continues() -> None:
    trace = [request([0, 1]), request([0, 2]), request([0, 1, 3]), request([0])]
    assert continued_later(trace, 2) == [True, False, False, False]
    oracle = ContinuationOracle(continued_later(trace, 2))
    decisions = [oracle.admit(r, c, 0).ram_blocks for r, c in zip(trace, contexts_of(trace))]
    assert decisions == [2, 0, 0, 0]


def test_the_later_turn_oracle_knows_only_later_turns_and_admits_first_turns_by_its_choice() -> (
    None
):
    trace = [
        request([0, 1]),  # first turn, continued
        request([0, 1, 2]),  # later turn, continued
        request([0, 5]),  # first turn, never continued
        request([0, 1, 2, 3]),  # later turn, not continued
        request([0, 9]),  # first turn, continued
        request([0, 9, 10]),  # later turn, not continued
    ]
    continued = continued_later(trace, 2)
    assert continued == [True, True, False, False, True, False]

    def decisions(first_turns: bool | None) -> list[int]:
        oracle = ContinuationOracle(continued, first_turns=first_turns)
        assert oracle.stats() == {"reads_the_future": True}
        return [oracle.admit(r, c, 0).ram_blocks for r, c in zip(trace, contexts_of(trace))]

    assert decisions(None) == [2, 3, 0, 0, 2, 0]
    assert decisions(False) == [0, 3, 0, 0, 0, 0]
    assert decisions(True) == [2, 3, 2, 0, 2, 0]
    assert ContinuationOracle(continued, first_turns=False).name == "oracle-later-first-none"
    assert ContinuationOracle(continued, first_turns=True).name == "oracle-later-first-all"


def rates(table: tuple[FollowUpRate, ...]) -> list[tuple[int, int]]:
    return [(rate.requests, rate.followed_up) for rate in table]


def test_the_follow_up_table_counts_each_sessions_requests_by_what_is_known_when_they_finish() -> (
    None
):
    long_session = [
        request([0, *range(20, 20 + turn)], output=200) for turn in range(1, 8)
    ]  # D: 7 turns
    trace = [
        request([0, 1], output=100),  # A, turn 1, 2 blocks: continued
        request([0, 5, 6, 7, 8], output=300),  # B, turn 1, 5 blocks: never continued
        request([0]),  # no session: too short for the two-block key
        request([0, 1, 2], output=50),  # A, turn 2: continued
        request([0, 9], output=1500),  # C, turn 1, 2 blocks: continued
        *long_session[:3],  # D, turns 1-3
        request([0, 1, 2, 3], output=50),  # A, turn 3: not continued
        request([0, 9, 10], output=50),  # C, turn 2: not continued
        *long_session[3:],  # D, turns 4-7, the last not continued
    ]
    table = follow_up_table(trace, contexts_of(trace), continued_later(trace, 2))
    # First turns A, C, D (2 blocks, continued) and B (5 blocks, not).
    assert [(rate.low, rate.high) for rate in table.first_turns_by_input_blocks] == [
        (1, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None),
    ]  # fmt: skip
    assert rates(table.first_turns_by_input_blocks) == [
        (3, 3),
        (0, 0),
        (1, 0),
        (0, 0),
        (0, 0),
        (0, 0),
        (0, 0),
    ]
    # Outputs: A 100, D 200, B 300, C 1500.
    assert rates(table.first_turns_by_output_tokens) == [(1, 1), (1, 1), (1, 0), (0, 0), (1, 1)]
    # Turn 2: A, C, D; turn 3: A, D; turns 4, 5: D; turns 6+: D's 6th and 7th.
    assert rates(table.by_turn) == [(4, 3), (3, 2), (2, 1), (1, 1), (1, 1), (2, 1)]
    assert table.by_turn[0].rate == 0.75 and table.first_turns_by_input_blocks[1].rate is None
    assert (table.by_turn[-1].low, table.by_turn[-1].high) == (6, None)


def kvci(**advisor_settings: float) -> WorthinessAdmission:
    return WorthinessAdmission(
        CheckpointAdvisor(**advisor_settings), prefill_tokens_per_second=8192.0
    )


def test_kvci_admits_a_long_settled_session_and_not_its_first_request() -> None:
    chain = list(range(60))  # 30k tokens
    policy = kvci()
    assert policy.admit(request(chain), RequestContext("s", 0, 0, 0, False, 60), 0).ram_blocks == 0
    admission = policy.admit(request(chain, at_ms=1), RequestContext("s", 6, 6, 0, False, 1), 0)
    assert admission.ram_blocks == 60
    assert policy.stats()["recommended"] == {"none": 1, "ram": 0, "disk": 1}


@pytest.mark.parametrize("blocks", [1, 8, 64, 256])
def test_with_default_constants_kvci_never_admits_a_sessions_first_request(blocks: int) -> None:
    # What the results depend on: with nothing but engine-measured fields, a first request has
    # predicted_reuse 0, context_stability 0 and, every block being novel, retrieval_saturation
    # at most 1/3, so its score stays under (0.30 + 0.15 / 3) / 0.70 = 0.5 < 0.55.
    policy = kvci()
    first = request(list(range(blocks)), output=4_000)
    assert policy.admit(first, RequestContext("new", 0, 0, 0, False, blocks), 0).ram_blocks == 0
    assert policy.stats()["recommended"] == {"none": 1, "ram": 0, "disk": 0}
    assert policy.stats()["gate_refusals"] == {}


def test_kvci_obeys_the_cache_gate() -> None:
    chain = list(range(60))
    settled = RequestContext("s", 6, 6, 0, False, 1)
    stopped = kvci()
    stopped.gate.set_kill_switch(True)
    assert stopped.admit(request(chain), settled, 0).ram_blocks == 0
    assert stopped.stats()["gate_refusals"] == {"kill_switch": 1}

    churning = kvci()
    for at_ms in (0, 1_000, 2_000):
        churning.admit(request(chain, at_ms=at_ms), RequestContext("s", 6, 0, 1, True, 30), 0)
    assert churning.admit(request(chain, at_ms=3_000), settled, 0).ram_blocks == 0
    assert churning.stats()["gate_refusals"].get("churn", 0) >= 1
    assert (
        churning.admit(request(chain, at_ms=400_000), settled, 0).ram_blocks == 60
    )  # the window passed


def test_kvci_admits_a_turn_that_adds_a_message_and_not_one_that_is_mostly_new_material() -> None:
    # Same size, same history (second turn): re-sending 59 known blocks and adding one is a
    # context that has converged; 59 new blocks behind the same root is one still taking in
    # material.
    chain = list(range(60))
    follow_up = kvci().admit(request(chain), RequestContext("s", 1, 1, 0, False, 1), 0)
    new_material = kvci().admit(request(chain), RequestContext("s", 1, 1, 0, False, 59), 0)
    assert (follow_up.ram_blocks, new_material.ram_blocks) == (60, 0)


def test_a_kvci_threshold_is_named_in_the_policy() -> None:
    assert kvci().name == "kvci-threshold"
    assert kvci(ram_threshold=0.4).name == "kvci-threshold@0.4"
    assert kvci_pressure().name == "kvci-pressure"


def kvci_pressure(capacity_blocks: int = 100) -> WorthinessAdmission:
    advisor = CheckpointAdvisor()
    bar: PressureAwareAdmission[int] = PressureAwareAdmission.for_advisor(
        advisor, capacity_bytes=capacity_blocks
    )
    return WorthinessAdmission(
        advisor, prefill_tokens_per_second=8192.0, pressure=bar, block_bytes=1
    )


def test_the_lru_cache_reports_each_evicted_block() -> None:
    evicted: list[int] = []
    cache = LRUBlockCache(2, on_evict=evicted.append)
    for block in (1, 2, 3):
        cache.insert(block)
    cache.touch(2)
    cache.insert(4)
    assert evicted == [1, 3]
    assert (1 in cache, 2 in cache, 3 in cache, 4 in cache) == (False, True, False, True)


def test_kvci_pressure_lowers_its_bar_when_a_held_back_first_turn_is_continued() -> None:
    policy = kvci_pressure()
    bar = policy.pressure
    assert bar is not None
    first = request(
        list(range(100, 160)), short_by=100
    )  # 30k tokens: scored ~0.34, under the bar of 0.55
    assert policy.admit(first, RequestContext("s", 0, 0, 0, False, 60), 0) == Admission(0, 0)
    second = request(
        [*range(100, 159), 500, 501], at_ms=60_000, short_by=100
    )  # re-sends the first's full blocks
    policy.admit(second, RequestContext("s", 1, 1, 0, False, 2), 0)
    assert bar.threshold == pytest.approx(0.54)
    assert bar.stats().missed_reuses == 1


def test_kvci_pressure_raises_its_bar_when_an_admitted_request_is_evicted_unused() -> None:
    policy = kvci_pressure()
    bar = policy.pressure
    assert bar is not None
    chain = list(range(60))
    assert (
        policy.admit(
            request(chain, short_by=100), RequestContext("s", 6, 6, 0, False, 1), 0
        ).ram_blocks
        == 60
    )
    policy.evicted(0)  # not the anchor: nothing learnt
    assert bar.threshold == 0.55
    policy.evicted(
        58
    )  # the anchor: the last full block (the 60th is partial), what a continuation hits
    assert bar.threshold == pytest.approx(0.56)
    assert policy.stats()["pressure"] == {
        "threshold": pytest.approx(0.56), "wasted_writes": 1, "missed_reuses": 0, "paid_writes": 0,
        "tracked_admitted": 0, "tracked_held_back": 0,
    }  # fmt: skip


# --- replay -----------------------------------------------------------------------------------


def test_replay_of_a_hand_worked_lru_example() -> None:
    trace = [request([1, 2]), request([1, 2, 3]), request([4, 5]), request([1, 2, 6])]
    tally = replay(trace, contexts_of(trace), StoreEverything("lru"), LRUBlockCache(3))
    # r1 writes 2, 1 (root most recent). r2 hits 1, 2 and writes 3; the root is re-touched, so
    # the order is 3, 2, 1. r3 writes 5 (evicts 3) and 4 (evicts 2). r4 finds 1, misses 2 and
    # writes 6 and 2.
    assert tally.ram_hit_blocks == 2 + 1
    assert tally.ram_saved_tokens == 2 * BLOCK_TOKENS + BLOCK_TOKENS
    assert tally.ram_blocks_written == 2 + 1 + 2 + 2
    assert tally.requests_with_hit == 2


def test_a_disk_tier_serves_what_ram_evicted_and_counts_apart() -> None:
    trace = [request([1, 2]), request([3, 4]), request([1, 2, 5])]
    tally = replay(
        trace, contexts_of(trace), StoreEverything("lru"), LRUBlockCache(2), LRUBlockCache(10)
    )
    assert (tally.ram_hit_blocks, tally.disk_hit_blocks) == (0, 2)
    assert tally.disk_saved_tokens == 2 * BLOCK_TOKENS
    assert tally.disk_blocks_written == 5  # write-through: every block once


@settings(max_examples=80, deadline=None)
@given(chains=chains(), capacity=st.integers(1, 40))
@example(chains=[(0,), (0,)], capacity=1)  # an exact repeat of a one-block prompt saves nothing
@example(chains=[(0, 1), (0, 1)], capacity=2)  # ... of a longer one, all but its last block
def test_replay_bounds_hold_for_every_policy(chains: list[tuple[int, ...]], capacity: int) -> None:
    trace = [request(chain, at_ms=i, short_by=(7 * i) % 3 * 100) for i, chain in enumerate(chains)]
    contexts = contexts_of(trace)
    distinct = {block for chain in chains for block in chain}
    seen: set[int] = set()
    ceiling = 0
    for r in trace:  # a cache that never evicts, computed independently of the replay
        usable = (r.input_length - 1) // BLOCK_TOKENS  # full blocks, never the last token
        run = 0
        while run < usable and r.hash_ids[run] in seen:
            run += 1
        ceiling += run * BLOCK_TOKENS
        seen.update(r.hash_ids[: r.input_length // BLOCK_TOKENS])  # no partial block is kept
    unbounded = replay(trace, contexts, StoreEverything("lru"), LRUBlockCache(len(distinct)))
    assert unbounded.ram_saved_tokens == ceiling
    assert unbounded.ram_blocks_written == len(seen)

    def policies(capacity: int) -> list[tuple[object, object]]:
        return [
            (StoreEverything("lru"), LRUBlockCache),
            (StoreEverything("arc"), ARCBlockCache),
            (StoreEverything("s3-fifo"), S3FIFOBlockCache),
            (StoreEverything("w-tinylfu"), WTinyLFUBlockCache),
            (bound := BeladyBound(trace, capacity), lambda n: bound),
            (StoreAfterNOffers(2), LRUBlockCache),
            (kvci(), LRUBlockCache),
            (
                pressured := kvci_pressure(capacity),
                lambda n: LRUBlockCache(n, on_evict=pressured.evicted),
            ),
            (RandomAdmission(0.5, seed=1), LRUBlockCache),
            (ContinuationOracle(continued_later(trace, 2)), LRUBlockCache),
        ]

    for policy, cache in policies(capacity):
        tally = replay(trace, contexts, policy, cache(capacity))  # type: ignore[operator,arg-type]
        assert tally.ram_saved_tokens <= ceiling
        assert tally.ram_hit_blocks <= tally.requested_blocks
    for policy, cache in policies(len(distinct)):
        roomy = replay(trace, contexts, policy, cache(len(distinct)))  # type: ignore[operator,arg-type]
        assert roomy.ram_blocks_written <= len(distinct), (
            "with room for all, no block is written twice"
        )
    roomy_bound = BeladyBound(trace, len(distinct))
    assert replay(trace, contexts, roomy_bound, roomy_bound).ram_saved_tokens == ceiling


@settings(max_examples=60, deadline=None)
@given(chains=chains())
def test_kvci_reads_each_prompt_as_the_context_bundle_of_its_turn(
    chains: list[tuple[int, ...]],
) -> None:
    # What the simulator passes is what a context bundle of the turn derives through the
    # observation's own path: items = the prompt's blocks, novel = not in the session's previous
    # prompt.
    trace = [request(chain, at_ms=i) for i, chain in enumerate(chains)]
    policy = kvci()
    previous: dict[tuple[int, ...], set[int]] = {}
    for r, c in zip(trace, contexts_of(trace)):
        observation = policy.observation(r, c, 0)
        if len(r.hash_ids) < 2:
            assert (observation.retrieved_items, observation.novel_items) == (None, None)
            continue
        known = previous.get(r.hash_ids[:2], set())
        bundle = {
            "items": [{"id": str(block), "novel": block not in known} for block in r.hash_ids]
        }
        derived = CheckpointObservation.from_inputs(context_bundle=bundle)
        assert (observation.retrieved_items, observation.novel_items) == (
            derived.retrieved_items,
            derived.novel_items,
        )
        previous[r.hash_ids[:2]] = set(r.hash_ids)


# --- the report ------------------------------------------------------------------------------


def result(name: str, role: Role, saved: int, written: int) -> PolicyResult:
    tally = Tally(
        requests=1, input_tokens=10**6, ram_saved_tokens=saved, ram_blocks_written=written
    )
    return PolicyResult.from_tally(name, "lru", role, tally, 1, {})


def test_the_targets_are_per_budget_for_the_policy_named_kvci_and_ask_for_the_best_online_too() -> (
    None
):
    assert [target_for(f).saved_ratio for f in (0.01, 0.025, 0.05, 0.10, 0.25)] == [
        1.9,
        1.7,
        1.2,
        1.05,
        1.0,
    ]
    assert [target_for(f).write_reduction for f in (0.01, 0.025, 0.05)] == [3.0, 3.0, None]
    assert target_for(0.5) is None

    def run(
        kvci_saved: int, kvci_written: int, best_saved: int, fraction: float = 0.01
    ) -> BudgetRun:
        results = [
            result("lru", "baseline", 1000, 300),
            result("arc", "baseline", best_saved, 300),
            result("kvci", "kvci", kvci_saved, kvci_written),
            result("kvci@0.4", "kvci", 5000, 1),
            result("oracle", "bound", 9000, 1),
            result("belady", "bound", 3000, 50),
        ]
        return budget_run(fraction, 10, 0, 1, 10_000, results)

    met = run(kvci_saved=1900, kvci_written=100, best_saved=1500)
    comparisons = {comparison.policy: comparison for comparison in met.comparisons}
    assert (met.best_online, met.best_online_saved_ratio, met.bound_saved_ratio) == (
        "arc",
        1.5,
        3.0,
    )
    assert comparisons["kvci"].target_met and comparisons["kvci"].at_least_best_online
    assert comparisons["kvci"].bound_share == pytest.approx(900 / 2000)
    assert comparisons["belady"].bound_share == 1.0 and comparisons["arc"].bound_share == 0.25
    assert not comparisons["kvci@0.4"].target_applies and comparisons["kvci@0.4"].target_met is None
    assert "lru" not in comparisons
    for missed in (run(1899, 100, 1500), run(1900, 101, 1500), run(1900, 100, 1901)):
        assert {c.policy: c for c in missed.comparisons}["kvci"].target_met is False
    roomy = {c.policy: c for c in run(1000, 301, 900, fraction=0.25).comparisons}["kvci"]
    assert roomy.target_met and roomy.target_write_reduction is None


# --- the command line and the results README ------------------------------------------------


def synthetic_trace() -> list[TraceRequest]:
    """Long conversations interleaved with one-off requests, over ten minutes."""
    requests = []
    fresh = 1000
    conversations = {c: [0, 100 + c] for c in range(6)}
    for step in range(120):
        conversation = step % 6
        if step % 2:
            chain = conversations[conversation] + list(range(fresh, fresh + 8))
            conversations[conversation] = chain
        else:
            chain = [0, *range(fresh, fresh + 10)]
        fresh += 10
        requests.append(request(chain, at_ms=step * 5_000))
    return requests


def run_module(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    # A wide console, so that the table does not shorten policy names.
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_writes_a_report_a_figure_and_a_readme(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "synthetic.jsonl", synthetic_trace())
    results = tmp_path / "results"
    done = run_module(
        "benchmarks.policy_sim",
        "--trace", str(trace), "--budgets", "0.1,0.5", "--disk-fraction", "1",
        "--kvci-ram-threshold", "0.55", "--kvci-ram-threshold", "0.4", "--out", str(results),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (
        "kvci-threshold@0.4" in done.stdout
        and "store-after-2" in done.stdout
        and "w-tinylfu" in done.stdout
    )
    report = SimulationReport.model_validate_json(
        (results / "policy_sim_synthetic.json").read_text()
    )
    assert report.label == "synthetic" and report.report_format == "kvci-policy-sim/3"
    assert (results / "policy_sim_synthetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [run.budget_fraction for run in report.runs] == [0.1, 0.5]
    assert report.working_set_blocks == len({b for r in synthetic_trace() for b in r.hash_ids})
    for run in report.runs:
        names = [result.name for result in run.policies]
        assert names == [
            "lru", "arc", "s3-fifo", "w-tinylfu", "store-after-2", "kvci", "kvci-restarted",
            "kvci-restarted-warm", "lru-restarted", "kvci-threshold", "kvci-threshold@0.4",
            "kvci-pressure", "random", "kvci-told-random",
            "oracle", "oracle-later-first-all", "oracle-later-first-none", "kvci-hindsight",
            "kvci-told", "belady",
        ]  # fmt: skip
        assert [result.name for result in run.policies if result.reads_the_future] == names[-6:]
        roles = {result.name: result.role for result in run.policies}
        assert [name for name in names if roles[name] == "baseline"] == names[:5]
        bar = run.policy("kvci-pressure").stats["pressure"]
        assert isinstance(bar, dict) and 0.30 <= bar["threshold"] <= 0.75  # type: ignore[operator]
        lru, bound = run.policy("lru"), run.policy("belady")
        assert (
            lru.disk_bytes_written == report.working_set_bytes
        )  # write-through, a disk that holds
        for result in run.policies:
            assert result.saved_tokens <= report.ceiling_saved_tokens
            assert result.ram_hit_blocks <= bound.ram_hit_blocks
            assert (
                result.bytes_written
                == (result.ram_blocks_written + result.disk_blocks_written) * report.block_bytes
            )
        by_name = {comparison.policy: comparison for comparison in run.comparisons}
        assert by_name["kvci"].saved_ratio == pytest.approx(
            run.policy("kvci").saved_tokens / lru.saved_tokens
        )
        assert run.bound_saved_ratio == pytest.approx(bound.saved_tokens / lru.saved_tokens)
        if bound.saved_tokens > lru.saved_tokens:
            assert by_name["belady"].bound_share == pytest.approx(1.0)
            share = (run.policy("arc").saved_tokens - lru.saved_tokens) / (
                bound.saved_tokens - lru.saved_tokens
            )
            assert by_name["arc"].bound_share == pytest.approx(share)
        best = max(run.policy(name).saved_tokens for name in names[:5])
        assert (
            run.policy(run.best_online).saved_tokens == best
            and roles[run.best_online] == "baseline"
        )
        kvci = by_name["kvci"]
        assert kvci.target_applies == (run.budget_fraction == 0.1)
        assert (
            not by_name["kvci-threshold@0.4"].target_applies and not by_name["arc"].target_applies
        )
        if kvci.target_applies:
            assert (kvci.target_saved_ratio, kvci.target_write_reduction) == (1.05, None)
            assert kvci.at_least_best_online == (run.policy("kvci").saved_tokens >= best)
            assert kvci.target_met == (kvci.at_least_best_online and kvci.saved_ratio >= 1.05)

    rendered = run_module("benchmarks.render_results", "--results", str(results))
    assert rendered.returncode == 0, rendered.stderr
    readme = (results / "README.md").read_text()
    assert (
        report.command in readme
        and "synthetic.jsonl" in readme
        and "## policy_sim_synthetic" in readme
    )
    for name in ("kvci-hindsight", "kvci-told", "kvci-told-random"):
        assert f"| {name} |" in readme  # beside the oracle-later bounds, against the targets
    # After the restart, each restarted tier against LRU restarted alike, from the reports' own
    # counts.
    assert "### After a restart" in readme
    for run in report.runs:
        after = {name: run.policy(name).stats["saved_tokens_after_restart"]
                 for name in ("kvci-restarted", "kvci-restarted-warm", "lru-restarted")}
        if after["lru-restarted"]:
            cold, warm, lru_after = after.values()
            gain = f"{warm / cold:.3f}x" if cold else "-"
            assert f"| {cold / lru_after:.3f}x | {warm / lru_after:.3f}x | {gain} |" in readme
    for run in report.runs:
        for comparison in run.comparisons:
            if comparison.target_applies:
                assert (
                    f"| {comparison.saved_ratio:.2f}x | >= {comparison.target_saved_ratio}x |"
                    in readme
                )
        for result in run.policies:
            assert f"| {result.name} | {result.saved_tokens:,} |" in readme
        by_name = {comparison.policy: comparison for comparison in run.comparisons}
        assert (
            f"{by_name['belady'].saved_ratio:.2f}x | {run.best_online_saved_ratio:.2f}x "
            f"({run.best_online}) |"
            in readme
        )
    assert "`oracle`, `oracle-later-first-all`, `oracle-later-first-none` read the future" in readme
    first = report.follow_up.by_turn[0]
    assert f"| all turns, by turn | 1 | {first.requests:,} | {first.followed_up:,} |" in readme
    again = run_module("benchmarks.render_results", "--results", str(results))
    assert again.returncode == 0 and (results / "README.md").read_text() == readme


def test_a_second_trace_gets_its_own_report_and_section(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for name in ("mooncake_first_trace.jsonl", "mooncake_second_trace.jsonl"):
        trace = write_trace(tmp_path / name, synthetic_trace())
        done = run_module(
            "benchmarks.policy_sim",
            "--trace",
            str(trace),
            "--budgets",
            "0.25",
            "--out",
            str(results),
        )
        assert done.returncode == 0, done.stderr
    labelled = run_module(
        "benchmarks.policy_sim", "--trace", str(trace), "--budgets", "0.25",
        "--label", "second-tuned", "--json", str(results / "named.json"),
    )  # fmt: skip
    assert labelled.returncode == 0, labelled.stderr
    assert sorted(path.name for path in results.iterdir()) == [
        "named.json", "policy_sim_first.json", "policy_sim_first.png",
        "policy_sim_second.json", "policy_sim_second.png",
    ]  # fmt: skip
    assert (
        SimulationReport.model_validate_json((results / "named.json").read_text()).label
        == "second-tuned"
    )
    assert run_module("benchmarks.render_results", "--results", str(results)).returncode == 0
    readme = (results / "README.md").read_text()
    for section in ("## named", "## policy_sim_first", "## policy_sim_second"):
        assert readme.count(section + "\n") == 1
    assert "Trace label `first`." in readme and "Trace label `second-tuned`." in readme


def test_the_cli_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [request([0, 1])])
    done = run_module("benchmarks.policy_sim", "--trace", str(trace), "--budgets", "0.01")
    assert done.returncode == 2
    assert "budget 0.01 of a 2-block working set holds no block" in done.stderr
    assert "Traceback" not in done.stderr
