"""A restart halfway through a trace, as the simulator replays it: the product's tier restarted
learning afresh or from its policy state file (through a real file), and LRU restarted alike."""

from __future__ import annotations

from bench.sim_traces import contexts_of, request
from benchmarks.policysim.admission import StoreEverything
from benchmarks.policysim.kvci_tier import KVCITier, replay_kvci
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.replay import replay
from benchmarks.policysim.restart import replay_lru_restarted, replay_restarted


def sessions_between_one_offs(n: int = 40) -> list:
    """Sessions that come back after 40 s, with a one-off that never does between their turns."""
    requests = []
    for i in range(n):
        session = (0, 1000 + 10 * i, 1001 + 10 * i)
        requests.append(request(session, at_ms=i * 60_000))
        requests.append(request((0, 5000 + i, 5100 + i), at_ms=i * 60_000 + 10_000))
        requests.append(request((*session, 1002 + 10 * i), at_ms=i * 60_000 + 40_000))
    return requests


def tier(policy, blocks: int = 4) -> KVCITier:
    return KVCITier(blocks, prefill_tokens_per_second=8192.0, policy=policy)


def roomy(policy) -> KVCITier:
    return tier(policy, 16)


def test_the_warm_restart_acts_on_what_the_first_half_learned() -> None:
    requests = sessions_between_one_offs()
    contexts = contexts_of(requests)
    cold, cold_stats = replay_restarted(requests, contexts, tier, warm=False)
    warm, warm_stats = replay_restarted(requests, contexts, tier, warm=True)
    assert cold.requests == warm.requests == len(requests)
    assert (
        cold_stats["restart_at_request"] == warm_stats["restart_at_request"] == len(requests) // 2
    )
    # Learning afresh, the tier weighs by its optimistic prior and keeps what it is offered; from
    # the state file it knows at once that one-offs do not come back and refuses them.
    assert cold_stats["after_restart"]["policy"]["refused_under_pressure"] == 0  # type: ignore[index]
    assert warm_stats["after_restart"]["policy"]["refused_under_pressure"] > 10  # type: ignore[index]


def test_a_restart_empties_the_ram_tier() -> None:
    """A context kept before the middle request and re-sent after it: the uninterrupted tiers
    hit it, the restarted ones cannot."""
    requests = [request((1, 2, 3), at_ms=0), request((9, 8), at_ms=1000),
                request((1, 2, 3, 4), at_ms=2000), request((7,), at_ms=3000)]
    contexts = contexts_of(requests)
    whole = replay_kvci(requests, contexts, roomy(None))
    restarted, stats = replay_restarted(requests, contexts, roomy, warm=False)
    assert whole.ram_hit_blocks == 3 and restarted.ram_hit_blocks == 0
    assert stats["saved_tokens_after_restart"] == 0
    lru = replay(requests, contexts, StoreEverything("lru"), LRUBlockCache(16))
    lru_restarted, lru_stats = replay_lru_restarted(requests, contexts, 16)
    assert lru.ram_hit_blocks == 3 and lru_restarted.ram_hit_blocks == 0
    assert lru_restarted.requests == len(requests) and lru_stats["restart_at_request"] == 2
    # A disk tier outlives the restart.
    _, disk_stats = replay_lru_restarted(requests, contexts, 16, disk=LRUBlockCache(16))
    assert disk_stats["saved_tokens_after_restart"] > 0
