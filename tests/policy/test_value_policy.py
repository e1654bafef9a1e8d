"""kvci's tier policy: each rule, explicit checkpoints kept whatever their value and evicted
last, chain order, and the policy inside the real RAMIndex under random operations (hypothesis)
against a reference model."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.policy import LRUPolicy, Offer, ValuePolicy, offer_rebuild_s
from kvci_plugin.policy.reuse_hazard import EDGES, ReuseHazard, bucket
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.retention import Retentions
from kvci_plugin.tiering.types import CheckpointBusyError, DoesNotFitError, NotWorthDisplacingError
from kvci_plugin.worthiness import CheckpointObservation, RebuildCostModel


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def chain(*blocks: int) -> list[bytes]:
    return [key(b) for b in blocks]


def index(pages: int, policy=None, clock=None, **kw) -> RAMIndex:
    return RAMIndex(pages, 1, 10_000, policy=policy or ValuePolicy(), clock=clock or Clock(), **kw)


def keep(ix: RAMIndex, cid: str, keys: list[bytes], **offer) -> None:
    ix.sight(Offer(anchor=keys[-1], **offer))
    ix.reserve(cid, "t", keys, offer=Offer(anchor=keys[-1], **offer))
    ix.commit(cid)


def held(ix: RAMIndex) -> set[str]:
    return {e.checkpoint_id for e in ix.entries()}


# ---- the hazard -------------------------------------------------------------------------------


def test_buckets_double_from_one_second() -> None:
    assert bucket(0.0) == 0 and bucket(0.99) == 0 and bucket(1.0) == 1 and bucket(3.0) == 2
    assert bucket(1e9) == len(EDGES) - 1


def test_a_class_that_comes_back_outranks_one_that_never_does() -> None:
    hazard = ReuseHazard()
    for _ in range(40):
        hazard.ended("back", 30.0, reused=True)
        hazard.ended("gone", 3000.0, reused=False)
    hazard.refresh({})
    assert hazard.resend_probability("back", 0.0, 60.0) > 10 * hazard.resend_probability(
        "gone", 0.0, 60.0
    )
    assert hazard.resend_probability("back", 0.0, 60.0) > 0.5
    # Past the age at which it always came back, holding it buys little.
    assert (
        hazard.resend_probability("back", 100.0, 60.0)
        < hazard.resend_probability("back", 0.0, 60.0) / 2
    )
    # A horizon shorter than the return buys less than one that reaches it.
    assert (
        hazard.resend_probability("back", 0.0, 8.0)
        < hazard.resend_probability("back", 0.0, 60.0) / 2
    )


def test_a_horizon_that_reaches_past_a_pause_counts_the_return() -> None:
    """Re-sent only after ~100 s (a tool call): at age 10 s a long enough horizon counts it."""
    hazard = ReuseHazard()
    for _ in range(40):
        hazard.ended("pause", 100.0, reused=True)
        hazard.ended("gone", 3000.0, reused=False)
    hazard.refresh({})
    assert hazard.resend_probability("pause", 10.0, 200.0) > 10 * hazard.resend_probability(
        "gone", 10.0, 200.0
    )


def test_contexts_still_idle_count_as_exposure() -> None:
    hazard = ReuseHazard()
    for _ in range(10):
        hazard.ended("c", 5.0, reused=True)
    hazard.refresh({})
    before = hazard.resend_probability("c", 0.0, 4000.0)
    hazard.refresh({"c": [5000.0] * 200})
    assert hazard.resend_probability("c", 0.0, 4000.0) < before / 2


def seconds_in_each_bucket(age: float) -> list[float]:
    """Reference: how long an idle period of ``age`` s spent in each idle-age bucket."""
    return [
        max(0.0, min(age, EDGES[j + 1] if j + 1 < len(EDGES) else age) - EDGES[j])
        for j in range(len(EDGES))
    ]


@given(ages=st.lists(st.floats(0.0, 2.0 * EDGES[-1], allow_nan=False), max_size=40))
def test_idle_exposure_counts_each_periods_seconds_in_each_bucket_ended_or_open(ages) -> None:
    """Ended one by one, or still open and summed in bulk (the refresh, a saved state), each idle
    period adds the seconds it spent in each bucket."""
    want = [sum(column) for column in zip(*map(seconds_in_each_bucket, ages))] or [0.0] * len(EDGES)
    one_by_one = ReuseHazard()
    for age in ages:
        one_by_one.ended("c", age, reused=False)
    bulk = ReuseHazard()
    bulk.ended("c", 0.0, reused=False)  # the class exists with nothing counted yet
    for counts in (one_by_one.counts({}), bulk.counts({"c": ages}).closed()):
        assert counts.exposure.get("c", [0.0] * len(EDGES)) == pytest.approx(
            want, rel=1e-12, abs=1e-9
        )


@settings(max_examples=40, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 7), st.sampled_from([None, 0.1, 0.4, 0.9]),
                                 st.sampled_from([None, True, False]),
                                 st.floats(0.0, 500.0, allow_nan=False), st.booleans()),
                       min_size=1, max_size=30))
def test_the_policy_counts_every_remembered_context_idle_in_its_own_class(events) -> None:
    """Each anchor the policy remembers adds its idle age so far to its class (band, capped
    re-sends, what the client said): checked against a per-anchor reference."""
    policy = ValuePolicy()
    now = 0.0
    ref: dict[int, list] = {}  # anchor -> [band, pending, reuses, last_seen]
    for n, score, pending, wait, resend in events:
        now += wait
        if resend and n in ref:
            policy.observe_lookup([key(n)], now)
            ref[n][2] += 1
            ref[n][3] = now
        else:
            offer = Offer(anchor=key(n), score=score, pending=pending)
            policy.sighted(offer, now)
            if n in ref:
                ref[n][:2] = [offer.band, pending]
            else:
                ref[n] = [offer.band, pending, 0, now]
    end = now + 30.0
    classes = {n: (band, min(reuses, 2), pending) for n, (band, pending, reuses, _) in ref.items()}
    expected = ReuseHazard()
    for n, (*_, seen) in ref.items():
        expected.ended(classes[n], end - seen, reused=False)
    got = policy.learned(end)
    assert got.idle.spent().keys() == Counter(classes.values()).keys()
    closed = got.closed()
    for cls, row in expected.counts({}).exposure.items():
        # What the policy already counted (re-sends end idle periods) plus what is still open.
        assert closed.exposure[cls] == pytest.approx(
            tuple(a + b for a, b in zip(row, got.exposure.get(cls, (0.0,) * len(EDGES)))),
            rel=1e-9,
            abs=1e-6,
        )


# ---- admission and eviction -------------------------------------------------------------------


def test_with_room_every_offer_is_kept() -> None:
    ix = index(10)
    for n in range(5):
        keep(ix, f"c{n}", chain(2 * n, 2 * n + 1))
    assert len(held(ix)) == 5
    assert ix.stats().policy.refused_under_pressure == 0


def learned(clock: Clock, ix: RAMIndex) -> None:
    """Teach the policy: a context re-sent every 10 s is worth keeping, one-offs are not."""
    keep(ix, "hot", chain(1, 2))
    for n in range(100):
        clock.now += 10.0
        ix.observe_lookup(chain(1, 2))
        # One-offs, never re-sent: looked up (a miss), then seen to finish, as the engine does.
        ix.observe_lookup(chain(1000 + n))
        ix.sight(Offer(anchor=key(1000 + n)))


def test_under_pressure_an_offer_worth_less_than_its_victim_is_refused_and_remembered() -> None:
    clock = Clock()
    ix = index(3, clock=clock)
    learned(clock, ix)
    keep(ix, "other", chain(50))
    clock.now += 10.0
    with pytest.raises(NotWorthDisplacingError):
        ix.reserve("oneoff", "t", chain(60, 61), offer=Offer(anchor=key(61)))
    assert held(ix) == {"hot", "other"}
    assert ix.stats().policy.refused_under_pressure == 1
    assert ix.stats().policy.tracked_anchors >= 100


def test_a_victim_a_retention_held_does_not_stretch_the_horizon() -> None:
    """The horizon is how long the tier holds what it admits: a checkpoint that stayed because
    a retention pinned it says nothing of that, whatever its idle age when it finally leaves."""
    clock = Clock()
    policy = ValuePolicy()
    ix = index(2, policy=policy, clock=clock)
    retentions = Retentions(ix, None, clock=clock)
    keep(ix, "retained", chain(1))
    retentions.grant("retained", "t", chain(1), 5000.0, "s")
    retentions.committed()
    keep(ix, "plain", chain(2))
    clock.now += 5.0
    keep(ix, "new", chain(3))  # the retained one is pinned: "plain" leaves, idle 5 s
    assert held(ix) == {"retained", "new"}
    clock.now += 2990.0
    ix.observe_lookup(chain(3))  # "new" is re-sent: young again
    clock.now += 10.0
    retentions.release_session("t", "s")  # the retained one competes again, idle 3,000 s
    keep(ix, "newer", chain(4))
    assert held(ix) == {"new", "newer"}
    assert ix.stats().policy.displaced == 2
    assert policy._horizon() == 5.0  # counted, the retained one's 3,000 s set it


def test_a_trimmed_checkpoint_keeps_its_context_and_leaves_first() -> None:
    """Its head is weighed as the context it was kept for, not as the page room ran out at: a
    lookup passing that page is no return of it; a re-send of its context is."""
    clock = Clock()
    ix = index(5, clock=clock)
    keep(ix, "a", chain(1, 2, 3))
    clock.now += 100.0
    keep(ix, "b", chain(9))
    clock.now += 1.0
    keep(ix, "c", chain(7))
    clock.now += 1.0
    res = ix.reserve("d", "t", chain(8), offer=Offer(anchor=key(8)))  # one page wanted
    ix.commit("d")
    assert [(e.checkpoint_id, e.trimmed) for e in res.evicted] == [("a", True)]
    assert ix.get("a", "t").keys == tuple(chain(1, 2)) and held(ix) == {"a", "b", "c", "d"}
    clock.now += 1.0
    res = ix.reserve("e", "t", chain(6), offer=Offer(anchor=key(6)))  # still the least valuable
    ix.commit("e")
    assert [(e.checkpoint_id, e.trimmed) for e in res.evicted] == [("a", True)]
    ix.observe_lookup(chain(1, 5))  # passes its last page: not its context, no return of it
    clock.now += 1.0
    res = ix.reserve("f", "t", chain(4), offer=Offer(anchor=key(4)))
    assert [(e.checkpoint_id, e.trimmed) for e in res.evicted] == [("a", False)]
    ix.commit("f")
    keep(ix, "g", chain(1, 2, 3))
    clock.now += 100.0
    keep(ix, "h", chain(11))
    keep(ix, "i", chain(12))
    res = ix.reserve("j", "t", chain(13), offer=Offer(anchor=key(13)))
    ix.commit("j")
    assert [(e.checkpoint_id, e.trimmed) for e in res.evicted] == [("g", True)]
    # Its context re-sent, it is young again: another leaves instead.
    ix.observe_lookup(chain(1, 2, 3))
    clock.now += 1.0
    res = ix.reserve("k", "t", chain(14), offer=Offer(anchor=key(14)))
    assert "g" not in {e.checkpoint_id for e in res.evicted}
    assert ix.get("g", "t").keys == tuple(chain(1, 2))


def test_the_head_of_a_checkpoint_already_leaving_vetoes_no_offer() -> None:
    """Admitting an offer over a checkpoint lets it go: evicted whole its pages were free for the
    next offers, so the head a trim left them is no ground to refuse one."""
    clock = Clock()
    policy = ValuePolicy()
    ix = index(4, policy=policy, clock=clock)
    learned(clock, ix)  # "hot" (2 pages) is re-sent every 10 s; one-offs never are
    keep(ix, "hot2", chain(20, 21))
    for _ in range(3):
        clock.now += 10.0
        ix.observe_lookup(chain(20, 21))
    clock.now += 10.0
    ix.observe_lookup(chain(1, 2))
    explicit = ix.reserve("x", "t", chain(30), offer=Offer(anchor=key(30), explicit=True))
    ix.commit("x")
    assert [(e.checkpoint_id, e.trimmed) for e in explicit.evicted] == [("hot2", True)]
    assert policy.admits(Offer(anchor=key(61)), ["hot2"], clock.now)  # its head: room
    with pytest.raises(NotWorthDisplacingError):  # a whole checkpoint of value is not
        ix.reserve("oneoff", "t", chain(60, 61), offer=Offer(anchor=key(61)))
    ix.observe_lookup(chain(20, 21))  # its context came back: it is held on its value again
    assert not policy.admits(Offer(anchor=key(61)), ["hot2"], clock.now)


def test_a_victim_whose_pages_stay_vetoes_no_offer() -> None:
    """A victim every page of which stays (the offer reuses it, or it leaves with a later
    victim) is not what the offer displaces: only victims whose pages leave are weighed."""
    clock = Clock()
    policy = ValuePolicy()
    ix = index(3, policy=policy, clock=clock)
    learned(clock, ix)
    assert not policy.admits(Offer(anchor=key(61)), ["hot"], clock.now)
    assert policy.admits(Offer(anchor=key(61)), ["hot"], clock.now, displaced=())
    assert not policy.admits(Offer(anchor=key(61)), ["hot"], clock.now, displaced={"hot"})


def test_a_checkpoint_trimmed_piece_by_piece_counts_once_in_the_horizon() -> None:
    """The horizon is the idle age of checkpoints as they leave: one a trim leaves piece by
    piece counts when it begins to, not again at each piece."""
    clock = Clock()
    policy = ValuePolicy()
    ix = index(4, policy=policy, clock=clock)
    keep(ix, "a", chain(1, 2, 3))
    clock.now += 10.0
    keep(ix, "b", chain(4))
    for n in range(2):
        clock.now += 100.0
        res = ix.reserve(f"n{n}", "t", chain(10 + n), offer=Offer(anchor=key(10 + n)))
        ix.commit(f"n{n}")
        assert [(e.checkpoint_id, e.trimmed) for e in res.evicted] == [("a", True)]
    assert list(policy._victim_ages) == [110.0]


def taught_by_the_word(clock: Clock, ix: RAMIndex, *, right: bool) -> None:
    """Contexts whose client said a tool call is pending, and contexts said nothing of; when the
    word is ``right`` the first come back 10 s later and the others never, else the reverse."""
    for n in range(100):
        clock.now += 10.0
        told, unsaid = chain(3000 + 2 * n), chain(3001 + 2 * n)
        for keys, pending in ((told, True), (unsaid, None)):
            ix.observe_lookup(keys)
            ix.sight(Offer(anchor=keys[-1], pending=pending))
        if n:
            ix.observe_lookup(chain(3000 + 2 * (n - 1) + (0 if right else 1)))


@pytest.mark.parametrize("right", [True, False])
def test_what_a_client_says_of_a_pending_tool_call_weighs_as_far_as_it_proves_right(right) -> None:
    """The word is evidence, learned per class: a context said to be coming back is kept over one
    said nothing of while the word proves right, and weighs less once it proves wrong."""
    clock, policy = Clock(), ValuePolicy()
    ix = index(2, policy=policy, clock=clock)
    taught_by_the_word(clock, ix, right=right)
    hazard = policy.reuse_hazard(clock.now)
    told, unsaid = (hazard.resend_probability((-1, 0, said), 0.0, 30.0) for said in (True, None))
    assert (told > 5 * unsaid) if right else (unsaid > 5 * told)
    keep(ix, "resident", chain(90, 91), pending=True)
    clock.now += 1.0
    newcomer = Offer(anchor=key(93), pending=None)
    ix.sight(newcomer)
    if right:
        with pytest.raises(NotWorthDisplacingError):
            ix.reserve("newcomer", "t", chain(92, 93), offer=newcomer)
        assert held(ix) == {"resident"}
    else:
        ix.reserve("newcomer", "t", chain(92, 93), offer=newcomer)
        ix.commit("newcomer")
        assert held(ix) == {"newcomer"}


def test_eviction_takes_the_lowest_value_first_not_the_oldest() -> None:
    clock = Clock()
    ix = index(4, clock=clock)
    learned(clock, ix)
    keep(ix, "oneoff", chain(70, 71))  # room: kept, and more recent than "hot"
    clock.now += 5.0
    res = ix.reserve("hot2", "t", chain(1, 2, 3, 4), offer=Offer(anchor=key(4)))
    assert [e.checkpoint_id for e in res.evicted] == ["oneoff"]  # LRU would have taken "hot"


def test_an_explicit_checkpoint_is_kept_whatever_its_value_and_leaves_last() -> None:
    clock = Clock()
    ix = index(5, clock=clock)
    learned(clock, ix)
    keep(ix, "now", chain(80, 81), explicit=True)  # a one-off, but asked for
    keep(ix, "x", chain(90))
    clock.now += 10.0
    # A system offer never displaces the explicit checkpoint: here only it could make room.
    with pytest.raises(NotWorthDisplacingError):
        ix.reserve("big", "t", chain(200, 201, 202, 203), offer=Offer(anchor=key(203)))
    # An explicit offer is admitted under pressure; the explicit checkpoint goes only when nothing
    # else can.
    res = ix.reserve("now2", "t", chain(95, 96), offer=Offer(anchor=key(96), explicit=True))
    ix.commit("now2")
    assert "now" in held(ix) and "now2" in held(ix)
    assert {e.checkpoint_id for e in res.evicted} <= {"x", "hot"}


def resent_after_drop(ix: RAMIndex) -> None:
    """A context kept, then gone (removed here; refused or evicted alike), then re-sent by a
    longer prompt's lookup: the policy remembers it without a checkpoint."""
    keep(ix, "a", chain(1, 2))
    ix.remove("a", "t")
    ix.observe_lookup(chain(1, 2, 3, 4))


def test_a_re_sent_prefix_is_kept_as_its_own_checkpoint_and_outlives_the_tail() -> None:
    ix = index(10)
    resent_after_drop(ix)
    keep(ix, "b", chain(1, 2, 3, 4))
    assert ix.keep_resent_prefix("b", "b-prefix")
    prefix = ix.get("b-prefix", "t")
    assert prefix.keys == tuple(chain(1, 2)) and ix.stats().pages == 4  # no page copied
    assert prefix.meta == ix.get("b", "t").meta
    ix.remove("b", "t")  # as if evicted: the tail leaves, the re-sent prefix stays loadable
    assert ix.longest_prefix(chain(1, 2, 3, 4), "t") == 2


def test_a_ghost_weighs_what_its_context_last_measured_while_it_was_held() -> None:
    ix = index(10)
    keep(ix, "a", chain(1, 2), rebuild_s_per_page=0.5)
    ix.observe_lookup(chain(1, 2, 3))  # re-sent while held
    ix.sight(Offer(anchor=key(2), rebuild_s_per_page=2.0))  # finished again, measured anew
    ix.remove("a", "t")  # a ghost now: its row alone
    keep(ix, "b", chain(1, 2, 3, 4))
    assert ix.keep_resent_prefix("b", "b-prefix")
    assert ix.get("b-prefix", "t").keys == tuple(chain(1, 2))
    # Held again, read back from its row: as measured last, not as first kept.
    assert ix._policy._record(key(2)).cost == 2.0


def test_no_prefix_is_kept_when_its_context_holds_a_checkpoint_or_was_never_re_sent() -> None:
    ix = index(10)
    keep(ix, "a", chain(1, 2))
    ix.observe_lookup(chain(1, 2, 3))
    keep(ix, "b", chain(1, 2, 3))
    assert not ix.keep_resent_prefix("b", "b-prefix")  # "a" still holds it
    # Remembered but never re-sent (the lookup came before it was seen): nothing proven.
    ix.observe_lookup(chain(7, 8, 9))
    ix.sight(Offer(anchor=key(8)))
    keep(ix, "c", chain(7, 8, 9))
    assert not ix.keep_resent_prefix("c", "c-prefix")
    assert held(ix) == {"a", "b", "c"}


def test_a_re_sent_prefix_never_displaces_anything_and_waits_for_the_commit() -> None:
    ix = RAMIndex(10, 1, 2, policy=ValuePolicy(), clock=Clock())  # two entries at most
    resent_after_drop(ix)
    keep(ix, "x", chain(50))
    ix.reserve("b", "t", chain(1, 2, 3, 4), offer=Offer(anchor=key(4)))
    with pytest.raises(CheckpointBusyError):
        ix.keep_resent_prefix("b", "b-prefix")
    ix.commit("b")
    assert not ix.keep_resent_prefix("b", "b-prefix")
    assert held(ix) == {"x", "b"}


def test_the_lru_baseline_keeps_no_prefix_of_its_own() -> None:
    ix = index(10, policy=LRUPolicy())
    resent_after_drop(ix)
    keep(ix, "b", chain(1, 2, 3, 4))
    assert not ix.keep_resent_prefix("b", "b-prefix")


def test_plain_reservations_without_offers_still_work() -> None:
    ix = index(2)
    ix.reserve("a", "t", chain(1))
    ix.commit("a")
    ix.reserve("b", "t", chain(2))
    ix.commit("b")
    res = ix.reserve("c", "t", chain(3))
    assert len(res.evicted) == 1


def test_a_reset_forgets_anchors_but_keeps_what_it_learned() -> None:
    clock = Clock()
    ix = index(8, clock=clock)
    learned(clock, ix)
    hot = ix._policy._hazard.resend_probability((-1, 0, 2), 0.0, 60.0)  # noqa: SLF001 - the table itself
    ix.clear()
    assert ix.stats().policy.tracked_anchors == 0 and not held(ix)
    assert ix._policy._hazard.resend_probability((-1, 0, 2), 0.0, 60.0) == hot  # noqa: SLF001


# ---- explicit checkpoints last, room kept, chain order: under random operations ---------------

ops = st.lists(
    st.tuples(st.sampled_from(["offer", "explicit", "lookup", "tick", "pin"]),
              st.integers(0, 2), st.integers(1, 4)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, pages=st.integers(3, 12))
def test_invariants_against_a_reference_model(ops, pages) -> None:
    """A reference model of the rules: capacity holds; an explicit checkpoint is never refused
    for want of value and leaves only when no other checkpoint could make room; every chain's
    resident pages are a prefix (a tail never outlives its root); with room nothing is refused."""
    clock = Clock()
    ix = index(pages, clock=clock)
    explicit: set[str] = set()
    n = 0
    for op, root, depth in ops:
        # Chains of a few roots, each extended to some depth: continuations share their parent's
        # pages.
        keys = [key(root * 100 + d) for d in range(depth)]
        if op == "tick":
            clock.now += 2.0 ** depth
            continue
        if op == "lookup":
            ix.observe_lookup(keys)
            continue
        if op == "pin":
            run = ix.longest_prefix(keys, "t")
            if run:
                ix.pin(keys[:run], "t")
                ix.unpin(keys[:run])
            continue
        n += 1
        cid = f"c{n}"
        offer = Offer(anchor=keys[-1], explicit=op == "explicit")
        free = pages - ix.stats().pages
        new = len(ix.absent(keys))
        before = held(ix)
        ix.observe_lookup(keys)  # as in the engine: a request's lookup comes before its finish
        ix.sight(offer)
        try:
            res = ix.reserve(cid, "t", keys, offer=offer)
        except NotWorthDisplacingError:
            assert not offer.explicit, "an explicit checkpoint was refused for want of value"
            assert new > free, "refused although the tier had room"
            assert held(ix) == before
            continue
        except DoesNotFitError:
            assert len(keys) > pages
            continue
        ix.commit(cid)
        if not offer.explicit:
            committed = held(ix)
            if ix.keep_resent_prefix(cid, f"{cid}p"):
                prefix = ix.get(f"{cid}p", "t").keys
                assert len(prefix) < len(keys) and tuple(keys[: len(prefix)]) == prefix
                assert held(ix) == committed | {f"{cid}p"}, (
                    "a re-sent prefix displaced a checkpoint"
                )
        left = {e.checkpoint_id for e in res.evicted}  # whole, or only their tails (trimmed)
        gone = {e.checkpoint_id for e in res.evicted if not e.trimmed}
        if left & explicit:
            # Only when every non-explicit checkpoint left (or is the newcomer's own pages) too.
            assert not (before - left - explicit), "an explicit checkpoint left before another"
        explicit -= gone
        if offer.explicit:
            explicit.add(cid)
        stats = ix.stats()
        assert stats.pages <= pages
        for root_ in range(6):
            resident = [
                ix.longest_prefix([key(root_ * 100 + d) for d in range(i + 1)], "t") == i + 1
                for i in range(4)
            ]
            assert resident == sorted(resident, reverse=True), (
                "a chain kept a tail without its root"
            )
    assert explicit <= held(ix)


def test_lru_policy_keeps_lru_order_and_explicit_last() -> None:
    ix = index(2, policy=LRUPolicy())
    keep(ix, "e", chain(1), explicit=True)
    keep(ix, "a", chain(2))
    res = ix.reserve("b", "t", chain(3), offer=Offer(anchor=key(3)))
    assert [e.checkpoint_id for e in res.evicted] == ["a"]


def test_lru_policy_refreshes_a_checkpoint_when_its_whole_context_is_resent() -> None:
    ix = index(5, policy=LRUPolicy())
    keep(ix, "a", chain(1, 2))
    keep(ix, "b", chain(3))
    keep(ix, "c", chain(4))
    # A later turn re-sends "a"'s context: "a" is now the most recently used.
    ix.observe_lookup(chain(1, 2, 9))
    res = ix.reserve("d", "t", chain(5, 6), offer=Offer(anchor=key(6)))
    assert [e.checkpoint_id for e in res.evicted] == ["b"]


def test_lru_policy_keeps_no_tail_alive_for_a_hit_on_the_prefix_it_shares() -> None:
    # Two users behind one system prompt (page 1), then a private chain. A new user's hit reads
    # page 1 alone: the holders' tails stay where they were, so the oldest user's tail leaves
    # first, as a block LRU would evict it, and the shared page stays with the other holder.
    ix = index(4, policy=LRUPolicy())
    keep(ix, "old", chain(1, 2))
    keep(ix, "mid", chain(1, 3))
    keep(ix, "solo", chain(8))
    ix.observe_lookup(chain(1, 7))
    ix.pin(chain(1), "t")
    ix.unpin(chain(1))
    res = ix.reserve("new", "t", chain(5), offer=Offer(anchor=key(5)))
    assert [e.checkpoint_id for e in res.evicted] == ["old"]
    assert ix.longest_prefix(chain(1, 3), "t") == 2 and ix.longest_prefix(chain(8), "t") == 1


def test_the_hit_rate_floor_is_the_bars_alone_by_default() -> None:
    from kvci_plugin.policy import default_hit_rate_floor
    from kvci_plugin.worthiness.cache_gate import HIT_RATE_FLOOR

    assert default_hit_rate_floor("threshold") == HIT_RATE_FLOOR
    assert default_hit_rate_floor("value") == default_hit_rate_floor("lru") == 0.0


def test_an_offer_is_weighed_by_its_work_not_by_a_noisy_wall_time() -> None:
    model = RebuildCostModel()
    base = CheckpointObservation(context_tokens=4096, output_tokens=96, tool_calls=2)
    work = 4192 / model.prefill_tokens_per_second + 2 * model.tool_call_seconds
    assert offer_rebuild_s(model, base) == pytest.approx(work)
    # A prefill that mostly hit, extrapolated to the whole prompt, reads as a slow rebuild: the
    # offer ignores it, so the same context is weighed alike however the engine was loaded.
    queued = base.model_copy(update={"wall_time_s": 40.0})
    assert model.estimate_observation(queued).seconds == 40.0
    assert offer_rebuild_s(model, queued) == pytest.approx(work)
    assert offer_rebuild_s(model, CheckpointObservation(wall_time_s=3.0)) is None  # no work known


@pytest.mark.parametrize("policy", [ValuePolicy, LRUPolicy])
def test_checkpoints_sharing_an_anchor_move_in_the_order_they_were_admitted(policy) -> None:
    """A re-send moves every checkpoint of its anchor: in the order they came, whatever their
    ids (random, in the engine: moved in a set's order, the policy chose differently from one
    run to the next)."""
    p = policy()
    admitted = []
    for n in range(20):
        offer = Offer(anchor=key(n))
        p.sighted(offer, 0.0)
        for _ in range(2):
            cid = uuid.uuid4().hex
            p.admitted(cid, offer, 0.0)
            admitted.append(cid)
    p.observe_lookup([key(n) for n in range(20)], 1.0)
    assert list(p.eviction_order({}, 1.0)) == admitted


def test_ghosts_past_their_bound_are_forgotten_a_bounded_number_at_a_time() -> None:
    """A forget (or a large eviction) turns many held anchors into ghosts at once: a sighting
    forgets at most ``FORGET_PER_SIGHTING`` of the excess, so its time on the scheduler thread
    stays bounded, and the sightings after it bring the ghosts back to their bound."""
    from kvci_plugin.policy.value_policy import FORGET_PER_SIGHTING

    policy = ValuePolicy(max_ghosts=4)
    ix = index(1000, policy=policy)
    many = 3 * FORGET_PER_SIGHTING
    for i in range(many):
        keep(ix, f"c{i}", chain(10_000 + i))
    ix.erase("t")  # every anchor a ghost now
    assert policy.tracked == many
    counts = []
    for i in range(5):
        ix.sight(Offer(anchor=key(20_000 + i)))  # a new anchor: a ghost more
        counts.append(policy.tracked)
    step = FORGET_PER_SIGHTING - 1
    assert counts == [many - step, many - 2 * step, 4, 4, 4]
