"""The simulator's baselines beside LRU (S3-FIFO, W-TinyLFU and its frequency sketch) and the
offline bound (Belady's MIN with bypass), against hand-worked cases and a brute-force optimum."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim_traces import chains, contexts_of, request
from benchmarks.policysim.admission import AdmissionPolicy, StoreEverything
from benchmarks.policysim.arc_cache import ARCBlockCache
from benchmarks.policysim.belady_bound import BeladyBound, is_chained, next_uses
from benchmarks.policysim.block_cache import BlockCache
from benchmarks.policysim.frequency_sketch import FrequencySketch
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.offer_threshold import StoreAfterNOffers
from benchmarks.policysim.oracle_admission import ContinuationOracle, continued_later
from benchmarks.policysim.random_admission import RandomAdmission
from benchmarks.policysim.replay import Tally, replay
from benchmarks.policysim.s3fifo_cache import S3FIFOBlockCache
from benchmarks.policysim.tinylfu_cache import WTinyLFUBlockCache
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest


def accesses_on(cache: BlockCache, blocks: Sequence[int]) -> int:
    """Drive a cache as a plain block stream (touch a resident block, insert a missing one);
    hits."""
    hits = 0
    for block in blocks:
        if block in cache:
            cache.touch(block)
            hits += 1
        else:
            cache.insert(block)
    return hits


# --- S3-FIFO ----------------------------------------------------------------------------------


def test_s3fifo_sends_one_hit_wonders_through_its_small_queue_and_keeps_reused_blocks() -> None:
    s3, lru = S3FIFOBlockCache(10), LRUBlockCache(10)
    for cache in (s3, lru):
        for block in (1, 2):  # inserted, then hit twice while in S: moves to M when S evicts
            cache.insert(block)
            cache.touch(block)
            cache.touch(block)
        for block in range(100, 130):  # a scan of blocks used once
            cache.insert(block)
    assert 1 in s3 and 2 in s3 and set(s3.main) == {1, 2}
    assert 1 not in lru and 2 not in lru
    # The scan left through S into the ghost, which holds as many ids as M may hold blocks.
    assert len(s3.ghost) == s3.capacity - s3.small_target == 9


def test_s3fifo_writes_a_block_its_ghost_remembers_into_the_main_queue() -> None:
    cache = S3FIFOBlockCache(10)
    for block in range(15):
        cache.insert(block)
    assert 0 in cache.ghost and 0 not in cache
    cache.insert(0)
    assert 0 in cache.main and 0 not in cache.ghost


def test_s3fifo_counts_hits_in_two_bits_and_moves_a_block_to_main_with_its_count() -> None:
    cache = S3FIFOBlockCache(10, move_to_main_hits=1)
    cache.insert(1)
    for _ in range(5):
        cache.touch(1)
    assert cache.small[1] == 3, "the frequency saturates at 3"
    for block in range(2, 12):
        cache.insert(block)
    assert cache.main == {1: 3}


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 12), blocks=st.lists(st.integers(0, 30), max_size=300))
def test_s3fifo_never_exceeds_its_capacity(capacity: int, blocks: list[int]) -> None:
    cache = S3FIFOBlockCache(capacity)
    for block in blocks:
        accesses_on(cache, [block])
        assert block in cache
        assert len(cache) <= capacity
        assert not set(cache.small) & set(cache.main)
        assert not set(cache.ghost) & (set(cache.small) | set(cache.main))
        assert len(cache.ghost) <= max(1, capacity - cache.small_target)
        assert all(
            0 <= frequency <= 3 for frequency in [*cache.small.values(), *cache.main.values()]
        )


# --- W-TinyLFU --------------------------------------------------------------------------------


def test_the_sketch_never_underestimates_before_it_ages_and_halves_when_it_does() -> None:
    sketch = FrequencySketch(64)
    counts = Counter({block: block % 7 for block in range(40)})
    for block, count in counts.items():
        for _ in range(count):
            sketch.record(block)
    assert sketch.resets == 0
    for block, count in counts.items():
        assert sketch.estimate(block) >= min(count, 16)  # count-min: collisions only add
    assert sketch.estimate(1000) <= 1
    before = sketch.estimate(6)
    for block in range(10_000, 10_000 + sketch.sample_size):  # one-offs until the sample is full
        sketch.record(block)
    assert sketch.resets == 1
    # Halved counters, doorkeeper cleared: 6 occurrences = doorkeeper 1 + counters 5 -> 2.
    assert sketch.estimate(6) <= (before - 1) // 2 + 1


def test_the_doorkeeper_absorbs_a_first_occurrence() -> None:
    sketch = FrequencySketch(1024)
    sketch.record(42)
    assert sketch.estimate(42) == 1
    sketch.record(42)
    assert sketch.estimate(42) == 2


def test_w_tinylfu_rejects_a_window_victim_used_less_than_the_main_victim() -> None:
    cache = WTinyLFUBlockCache(100)  # window 1, main 99 (protected 79)
    assert (cache.window_capacity, cache.main_capacity) == (1, 99)
    for block in range(100):
        cache.insert(block)
        cache.touch(block)  # each used twice: estimate 2
    assert len(cache) == 100 and cache.rejected == 0
    for block in range(1000, 1050):  # a scan of one-offs
        cache.insert(block)
    # Each one-off (estimate 1) lost to the main victim (estimate 2): only the newest stays, in the
    # window. 99, the window's when the scan began, tied with the main victim and lost too.
    assert cache.rejected == 50 and list(cache.window) == [1049]
    assert all(block in cache for block in range(99)) and 99 not in cache


def test_w_tinylfu_promotes_a_probation_hit_and_demotes_protected_overflow() -> None:
    cache = WTinyLFUBlockCache(12)  # window 1, main 11: protected 8
    for block in range(12):
        cache.insert(block)
    for block in range(11):  # 11 is in the window
        cache.touch(block)
    assert len(cache.protected) == cache.protected_capacity == 8
    assert list(cache.protected) == list(range(3, 11)) and list(cache.probation) == [0, 1, 2]


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 150), blocks=st.lists(st.integers(0, 200), max_size=400))
def test_w_tinylfu_never_exceeds_its_capacity_or_its_segments(
    capacity: int, blocks: list[int]
) -> None:
    cache = WTinyLFUBlockCache(capacity)
    for block in blocks:
        accesses_on(cache, [block])
        assert len(cache) <= capacity
        assert len(cache.window) <= cache.window_capacity
        assert len(cache.protected) <= cache.protected_capacity
        assert len(cache.probation) + len(cache.protected) <= cache.main_capacity
        segments = (set(cache.window), set(cache.probation), set(cache.protected))
        assert sum(map(len, segments)) == len(set().union(*segments))


def test_the_replay_counts_a_rejected_window_victim_as_written_once() -> None:
    # Capacity 1: no main cache; every new block is written into the window and pushes the block
    # there out, rejected, with no write. Request 1 writes 1 then 0 (1 rejected); request 2 hits 0,
    # writes 2 (0 rejected) and its root 0 again (2 rejected); request 3 the same with 1.
    trace = [request([0, 1]), request([0, 2]), request([0, 1])]
    cache = WTinyLFUBlockCache(1)
    tally = replay(trace, contexts_of(trace), StoreEverything("w-tinylfu"), cache)
    assert (tally.ram_blocks_written, tally.ram_hit_blocks, cache.rejected) == (6, 2, 5)


# --- determinism ------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(chains=chains(), capacity=st.integers(1, 30))
def test_every_cache_replays_a_trace_the_same_way_twice(
    chains: list[tuple[int, ...]], capacity: int
) -> None:
    trace = [request(chain, at_ms=i) for i, chain in enumerate(chains)]
    contexts = contexts_of(trace)
    for cache in (S3FIFOBlockCache, WTinyLFUBlockCache, ARCBlockCache):
        first = replay(trace, contexts, StoreEverything("x"), cache(capacity))
        assert replay(trace, contexts, StoreEverything("x"), cache(capacity)) == first
    bounds = [BeladyBound(trace, capacity) for _ in range(2)]
    assert replay(trace, contexts, bounds[0], bounds[0]) == replay(
        trace, contexts, bounds[1], bounds[1]
    )


def test_arc_replays_a_request_that_evicts_and_writes_again_a_block_it_was_served() -> None:
    # Found by the property below: with one block of room, a request served from T2 evicts that
    # block with its own writes and writes it again, into T1, where its refresh must find it.
    trace = [
        request(chain, at_ms=i) for i, chain in enumerate([(0,), (0, 1), (0, 2, 1), (0, 2, 1, 3)])
    ]
    arc = replay(trace, contexts_of(trace), StoreEverything("arc"), ARCBlockCache(1))
    assert arc.requests == len(trace)
    assert arc == replay(trace, contexts_of(trace), StoreEverything("arc"), ARCBlockCache(1))


# --- the offline bound ------------------------------------------------------------------------


def test_next_uses_name_the_next_request_holding_each_block() -> None:
    trace = [request([0, 1]), request([0, 2]), request([0, 1, 3]), request([4])]
    assert next_uses(trace) == [[1, 2], [2, 4], [4, 4, 4], [4]]
    assert is_chained(trace)
    assert not is_chained([request([0, 1]), request([2, 1])])


def test_the_bound_writes_no_block_it_never_sees_again_and_bypasses_a_far_one() -> None:
    trace = [request([0, 1, 2]), request([5, 6]), request([0, 1, 3]), request([5, 6, 4])]
    bound = BeladyBound(trace, 2)
    tally = replay(trace, contexts_of(trace), bound, bound)
    # 0 and 1 are kept for request 3; 2 and 3 are never used again; 5, 6 come back later than 0,
    # 1 are needed, so they are bypassed (not written) rather than evicting them; request 4
    # misses, and nothing after it uses its blocks.
    assert tally.ram_blocks_written == 2
    assert tally.ram_hit_blocks == 2
    assert bound.stats() == {
        "reads_the_future": True,
        "chained": True,
        "bypassed_blocks": 2,
        "never_used_again_blocks": 1 + 1 + 3,
        "evicted_blocks": 0,
    }


def test_the_bound_evicts_a_chain_from_its_tail() -> None:
    # Capacity 3: after request 1 holds 0, 1, 2, request 2 needs 7 sooner than 2 and 1 are used
    # again.
    trace = [request([0, 1, 2]), request([7, 8]), request([7, 8]), request([0, 1, 2, 9])]
    bound = BeladyBound(trace, 3)
    tally = replay(trace, contexts_of(trace), bound, bound)
    assert tally.ram_hit_blocks == 1 + 2  # 7 once, then 0 and 1 (2 left first, from the tail)
    assert tally.ram_blocks_written == 3 + 1


def optimum(trace: Sequence[TraceRequest], capacity: int) -> tuple[int, int]:
    """The most RAM hit blocks, and the most saved tokens, any replay policy gets: exhaustively.

    After each request's lookup (its leading resident run within ``hit_blocks`` hits), the tier
    may keep any set of at most ``capacity`` blocks drawn from what it held and the request's full
    blocks. A block no later hit could cover is dropped (it can only take room).
    """
    later = [set(block for r in trace[index + 1:] for block in r.hash_ids[: r.hit_blocks])
             for index in range(len(trace))]
    best: dict[frozenset[int], tuple[int, int]] = {frozenset(): (0, 0)}
    for index, r in enumerate(trace):
        step: dict[frozenset[int], tuple[int, int]] = {}
        for held, (hits, saved) in best.items():
            run = 0
            while run < r.hit_blocks and r.hash_ids[run] in held:
                run += 1
            gained = (hits + run, saved + run * BLOCK_TOKENS)
            pool = sorted((held | set(r.hash_ids[: r.full_blocks])) & later[index])
            for size in range(min(capacity, len(pool)) + 1):
                for kept in itertools.combinations(pool, size):
                    state = frozenset(kept)
                    previous = step.get(state, (0, 0))
                    step[state] = (max(previous[0], gained[0]), max(previous[1], gained[1]))
        best = step
    return max(hits for hits, _ in best.values()), max(saved for _, saved in best.values())


def others(
    trace: Sequence[TraceRequest],
) -> list[tuple[AdmissionPolicy, Callable[[int], BlockCache]]]:
    return [
        (StoreEverything("lru"), LRUBlockCache),
        (StoreEverything("arc"), ARCBlockCache),
        (StoreEverything("s3-fifo"), S3FIFOBlockCache),
        (StoreEverything("w-tinylfu"), WTinyLFUBlockCache),
        (StoreAfterNOffers(2), LRUBlockCache),
        (RandomAdmission(0.5, seed=3), LRUBlockCache),
        (ContinuationOracle(continued_later(trace, 2)), LRUBlockCache),
    ]


def replay_bound(trace: Sequence[TraceRequest], capacity: int) -> tuple[BeladyBound, Tally]:
    bound = BeladyBound(trace, capacity)
    return bound, replay(trace, contexts_of(trace), bound, bound)


@settings(max_examples=120, deadline=None)
@given(
    chains=chains(max_requests=7, max_grow=3),
    capacity=st.integers(1, 3),
    short_by=st.sampled_from([0, 100, 511]),
)
def test_the_bound_gets_the_most_hit_blocks_and_saved_tokens_of_any_policy_exactly(
    chains: list[tuple[int, ...]], capacity: int, short_by: int
) -> None:
    trace = [request(chain, at_ms=i, short_by=short_by) for i, chain in enumerate(chains)]
    best_hits, best_saved = optimum(trace, capacity)
    _, tally = replay_bound(trace, capacity)
    assert tally.ram_hit_blocks == best_hits
    assert tally.ram_saved_tokens == best_saved  # a hit covers full blocks only: tokens are exact
    for policy, cache in others(trace):
        other = replay(trace, contexts_of(trace), policy, cache(capacity))
        assert other.ram_hit_blocks <= tally.ram_hit_blocks, policy.name
        assert other.ram_saved_tokens <= best_saved, policy.name


@settings(max_examples=80, deadline=None)
@given(chains=chains(), capacity=st.integers(1, 40))
def test_the_bound_beats_every_policy_and_keeps_its_resident_set_prefix_closed(
    chains: list[tuple[int, ...]], capacity: int
) -> None:
    trace = [request(chain, at_ms=i, short_by=0) for i, chain in enumerate(chains)]
    contexts = contexts_of(trace)
    bound = BeladyBound(trace, capacity)
    predecessor = {chain[p]: chain[p - 1] for chain in chains for p in range(1, len(chain))}
    blocks = {block for chain in chains for block in chain}
    saved = 0
    for index, (r, c) in enumerate(zip(trace, contexts)):
        before = {block for block in blocks if block in bound}
        saved += replay([r], [c], bound, bound).ram_saved_tokens
        resident = {block for block in blocks if block in bound}
        assert len(resident) == len(bound) <= capacity
        assert all(predecessor[block] in resident for block in resident if block in predecessor)
        later = {block for following in trace[index + 1:] for block in following.hash_ids}
        assert resident - before <= later, "a block never used again was written"
    for policy, cache in others(trace):
        other = replay(trace, contexts, policy, cache(capacity))
        assert saved >= other.ram_saved_tokens, policy.name


def test_the_bound_refuses_a_trace_it_was_not_built_for() -> None:
    bound = BeladyBound([request([0, 1])], 2)
    with pytest.raises(ValueError, match="is not the bound's trace's request 1"):
        replay([request([0, 2])], contexts_of([request([0, 2])]), bound, bound)
