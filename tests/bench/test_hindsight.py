"""The hindsight bound: kvci's own policy weighing by what it learned over the whole trace."""

from __future__ import annotations

from bench.sim_traces import contexts_of, request
from benchmarks.policysim.hindsight import FrozenHazard, hindsight_policy
from benchmarks.policysim.kvci_tier import KVCITier, replay_kvci
from kvci_plugin.policy import Offer, ValuePolicy
from kvci_plugin.policy.reuse_hazard import ReuseHazard

CLS = (1, 0, None)


def test_a_frozen_hazard_weighs_as_the_learned_one_did_and_learns_nothing_more() -> None:
    learned = ReuseHazard()
    for age in (3.0, 5.0, 6.0):
        learned.ended(CLS, age, reused=True)
    learned.refresh({})
    frozen = FrozenHazard(learned)
    before = [frozen.resend_probability(CLS, age, 10.0) for age in (0.0, 4.0, 100.0)]
    assert before == [learned.resend_probability(CLS, age, 10.0) for age in (0.0, 4.0, 100.0)]
    for _ in range(50):  # a flood of contexts never re-sent would teach an online hazard otherwise
        frozen.ended(CLS, 4.0, reused=False)
        learned.ended(CLS, 4.0, reused=False)
    frozen.refresh({CLS: [1000.0]})
    learned.refresh({CLS: [1000.0]})
    assert [frozen.resend_probability(CLS, age, 10.0) for age in (0.0, 4.0, 100.0)] == before
    assert learned.resend_probability(CLS, 4.0, 10.0) < before[1]


def test_the_learned_hazard_counts_the_contexts_still_idle() -> None:
    policy = ValuePolicy()
    offer = Offer(anchor=b"a", score=0.3)
    policy.sighted(offer, 0.0)  # never re-sent: an hour idle says contexts of its class stay away
    cls = (offer.band, 0)
    prior = ValuePolicy().reuse_hazard(0.0).resend_probability(cls, 1000.0, 1000.0)
    assert policy.reuse_hazard(3600.0).resend_probability(cls, 1000.0, 1000.0) < prior


def test_hindsight_replays_the_product_tier_and_learns_nothing_more() -> None:
    # Sessions that come back after 30 s, between one-offs that never do, through a 4-block tier.
    requests = []
    for n in range(20):
        session = (0, 1000 + 10 * n, 1001 + 10 * n)
        requests.append(request(session, at_ms=n * 60_000))
        requests.append(request((0, 5000 + n, 5100 + n), at_ms=n * 60_000 + 10_000))
        requests.append(request((*session, 1002 + 10 * n), at_ms=n * 60_000 + 40_000))
    contexts = contexts_of(requests)
    online = KVCITier(4, prefill_tokens_per_second=8192.0)
    replay_kvci(requests, contexts, online)
    assert isinstance(online.policy, ValuePolicy)
    end_s = requests[-1].timestamp_ms / 1000.0
    policy = hindsight_policy(online.policy, end_s)
    assert policy is not online.policy and policy.tracked == 0 < online.policy.tracked
    cls = (Offer(anchor=b"x", score=0.5).band, 0)
    learned = online.policy.reuse_hazard(end_s)
    weighed = [learned.resend_probability(cls, age, 30.0) for age in (0.0, 20.0)]
    bound = KVCITier(4, prefill_tokens_per_second=8192.0, policy=policy)
    tally = replay_kvci(requests, contexts, bound)
    assert tally.ram_saved_tokens > 0 and bound.stats()["policy"]["admitted"] > 0  # type: ignore[index]
    # Weighing as the online run had learned by the end, before the replay and after it alike.
    assert [
        policy.reuse_hazard(end_s).resend_probability(cls, age, 30.0) for age in (0.0, 20.0)
    ] == weighed
