from __future__ import annotations

import threading

import pytest

from kvci_plugin.worthiness import (
    CacheGate,
    CacheGateDecision,
    CacheGateRule,
    RequestHistory,
    churn_keeps,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gate(**kwargs: object) -> tuple[CacheGate, Clock]:
    clock = Clock()
    return CacheGate(clock=clock, **kwargs), clock  # type: ignore[arg-type]


def lookups(target: CacheGate, hits: int, misses: int) -> None:
    for _ in range(hits):
        target.record_lookup(True)
    for _ in range(misses):
        target.record_lookup(False)


def test_default_is_allow_and_every_rule_was_evaluated() -> None:
    decision = gate()[0].decide("s1")
    assert decision.allow
    assert decision.rule is CacheGateRule.DEFAULT
    assert [(e.rule, e.matched) for e in decision.evaluated] == [
        (CacheGateRule.KILL_SWITCH, False),
        (CacheGateRule.HIT_RATE_FLOOR, False),
        (CacheGateRule.CHURN, False),
        (CacheGateRule.DEFAULT, True),
    ]


def test_the_kill_switch_wins_first() -> None:
    target, _ = gate(kill_switch=True, min_lookups=1, hit_rate_window=4, churn_threshold=1)
    lookups(target, 0, 4)
    target.record_context_change("s1")
    decision = target.decide("s1")
    assert not decision.allow
    assert decision.rule is CacheGateRule.KILL_SWITCH
    assert decision.inputs == {"kill_switch": True}
    assert [e.rule for e in decision.evaluated] == [CacheGateRule.KILL_SWITCH]  # first match wins
    target.set_kill_switch(False)
    assert target.decide("s1").rule is CacheGateRule.HIT_RATE_FLOOR


def test_no_hit_rate_decision_until_the_window_has_data() -> None:
    target, _ = gate(min_lookups=10, hit_rate_window=20)
    lookups(target, 0, 9)
    decision = target.decide()
    assert decision.allow
    assert decision.evaluated[1].inputs["lookups"] == 9
    assert decision.evaluated[1].inputs["hit_rate"] == 0.0
    target.record_lookup(False)
    assert target.decide().rule is CacheGateRule.HIT_RATE_FLOOR


def test_the_hit_rate_floor_pauses_stores_that_do_not_pay_back() -> None:
    target, _ = gate(min_lookups=10, hit_rate_window=10)
    lookups(target, 2, 8)
    paused = target.decide()
    assert not paused.allow
    assert paused.rule is CacheGateRule.HIT_RATE_FLOOR
    assert paused.inputs["hit_rate"] == pytest.approx(0.2)
    assert paused.inputs["floor"] == 0.30
    assert (paused.inputs["hits"], paused.inputs["lookups"]) == (2, 10)
    # The window rolls: five fresh hits push the five oldest lookups (2 hits, 3 misses) out.
    lookups(target, 5, 0)
    assert target.hit_rate() == pytest.approx(0.5)
    assert target.decide().allow


def test_the_floor_itself_is_enough() -> None:
    target, _ = gate(min_lookups=10, hit_rate_window=10)
    lookups(target, 3, 7)
    assert target.decide().allow


def test_a_long_pause_restarts_the_window_so_stores_can_earn_hits_again() -> None:
    target, _ = gate(min_lookups=2, hit_rate_window=4, hit_rate_retry_after=3)
    lookups(target, 0, 4)
    refusals = [target.decide() for _ in range(3)]
    assert [d.rule for d in refusals] == [CacheGateRule.HIT_RATE_FLOOR] * 3
    assert [d.inputs["refusals_in_a_row"] for d in refusals] == [1, 2, 3]
    assert refusals[-1].inputs["window_restarted"] is True
    assert target.hit_rate() is None
    assert target.decide().allow
    lookups(target, 0, 2)
    assert target.decide().rule is CacheGateRule.HIT_RATE_FLOOR


def test_churn_pauses_a_session_whose_context_keeps_changing() -> None:
    target, clock = gate(churn_window_s=60.0, churn_threshold=3)
    for _ in range(2):
        target.record_context_change("busy")
        clock.now += 10
    assert target.decide("busy").allow
    target.record_context_change("busy")
    decision = target.decide("busy")
    assert not decision.allow
    assert decision.rule is CacheGateRule.CHURN
    assert decision.inputs == {
        "session_known": True,
        "changes_in_window": 3,
        "window_s": 60.0,
        "threshold": 3,
    }
    assert "busy" not in decision.model_dump_json()  # numbers only
    assert target.decide("calm").allow
    assert target.decide(None).allow
    clock.now += 41  # the first change leaves the window
    assert target.decide("busy").allow


def test_a_churn_pause_still_offers_the_prefix_the_rewrite_kept_and_nothing_else_does() -> None:
    target, _ = gate(churn_threshold=2)
    history = RequestHistory()
    first = history.turn("s", ("sys", "tools", "a1", "a2"))
    rewrite = history.turn("s", ("sys", "tools", "b1"))  # kept the system prompt and tools
    assert (first.kept_items, rewrite.rewrote, rewrite.kept_items) == (0, True, 2)
    target.record_context_change("s")
    assert churn_keeps(target.decide("s"), rewrite) == 0  # allowed: nothing to narrow
    target.record_context_change("s")
    churned = target.decide("s")
    assert churned.rule is CacheGateRule.CHURN
    assert churn_keeps(churned, rewrite) == 2
    assert churn_keeps(churned, None) == 0  # no session turn measured
    # A turn that only extended its previous prompt is paused whole in a churning session.
    grown = history.turn("s", ("sys", "tools", "b1", "b2"))
    assert (grown.rewrote, grown.kept_items) == (False, 3)
    assert churn_keeps(churned, grown) == 0
    # A turn that kept nothing, and the other rules, pause everything.
    fresh = history.turn("s", ("new",))
    assert (fresh.rewrote, churn_keeps(churned, fresh)) == (True, 0)
    target.set_kill_switch(True)
    assert churn_keeps(target.decide("s"), rewrite) == 0


def test_the_floor_is_evaluated_before_churn() -> None:
    target, _ = gate(min_lookups=1, hit_rate_window=1, churn_threshold=1)
    target.record_lookup(False)
    target.record_context_change("s")
    decision = target.decide("s")
    assert decision.rule is CacheGateRule.HIT_RATE_FLOOR
    assert [e.rule for e in decision.evaluated] == [
        CacheGateRule.KILL_SWITCH,
        CacheGateRule.HIT_RATE_FLOOR,
    ]


def test_tracked_sessions_are_bounded_least_recent_first() -> None:
    target, _ = gate(churn_threshold=1, max_tracked_sessions=2)
    target.record_context_change("a")
    target.record_context_change("b")
    target.record_context_change("a")
    target.record_context_change("c")  # evicts b, the least recently changed
    assert not target.decide("a").allow
    assert target.decide("b").allow
    assert not target.decide("c").allow


def test_decisions_round_trip_through_json() -> None:
    target, _ = gate(min_lookups=1, hit_rate_window=2)
    lookups(target, 0, 2)
    for decision in (target.decide("s"), gate()[0].decide()):
        restored = CacheGateDecision.model_validate_json(decision.model_dump_json())
        assert restored == decision


def test_concurrent_lookups_are_all_counted() -> None:
    target, _ = gate(hit_rate_window=100_000, min_lookups=1)
    threads = [threading.Thread(target=lookups, args=(target, 500, 500)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    decision = target.decide()
    assert decision.evaluated[1].inputs["lookups"] == 4000
    assert decision.evaluated[1].inputs["hits"] == 2000


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"kill_switch": 1}, TypeError),
        ({"hit_rate_floor": 1.5}, ValueError),
        ({"hit_rate_floor": float("nan")}, ValueError),
        ({"hit_rate_window": 0}, ValueError),
        ({"min_lookups": 0}, ValueError),
        ({"min_lookups": 20, "hit_rate_window": 10}, ValueError),
        ({"hit_rate_retry_after": 0}, ValueError),
        ({"churn_window_s": 0.0}, ValueError),
        ({"churn_window_s": float("inf")}, ValueError),
        ({"churn_threshold": 0}, ValueError),
        ({"churn_threshold": 2.5}, TypeError),
        ({"max_tracked_sessions": 0}, ValueError),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        CacheGate(**kwargs)  # type: ignore[arg-type]


def test_bad_calls_are_refused() -> None:
    target = CacheGate()
    with pytest.raises(TypeError, match="hit"):
        target.record_lookup(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="session_id"):
        target.record_context_change("")
    with pytest.raises(TypeError, match="session_id"):
        target.decide(7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enabled"):
        target.set_kill_switch("off")  # type: ignore[arg-type]
