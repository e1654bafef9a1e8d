"""The engine's word on a turn's end in the keep decision: it stands for the client's
``tool_call_pending`` when the client said nothing, its pauses are learned per class, and a kept
tool-call turn asks for automatic retention for the learned TTL; without it nothing changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from worthiness.fixed_scorers import FixedScorer

from kvci_plugin.policy import FinishedRequest, KeepDecider, ReturnGaps, ram_policy_for
from kvci_plugin.policy.return_gaps import END_OF_TURN, TOOL_CALL
from kvci_plugin.worthiness import (
    CacheGate,
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointScorerRegistry,
)
from kvci_plugin.worthiness.scorers import CONTEXT_STABILITY, PREDICTED_REUSE, REBUILD_COST

KEYS = ("k1", "k2", "k3", "k4")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def advisor(value: float) -> CheckpointAdvisor:
    return CheckpointAdvisor(CheckpointScorerRegistry(
        [FixedScorer(name, 1.0, value) for name in (REBUILD_COST, PREDICTED_REUSE,
                                                    CONTEXT_STABILITY)]))


def decider(value: float = 0.6, *, gaps: ReturnGaps | None = None, max_retain_s: float = 300.0,
            **settings: Any) -> tuple[KeepDecider, Clock]:
    clock = Clock()
    return KeepDecider(ram=ram_policy_for("value"), advisor=advisor(value), gate=CacheGate(),
                       return_gaps=gaps if gaps is not None else ReturnGaps(prior_s=20.0),
                       max_retain_s=max_retain_s, clock=clock, **settings), clock


def finished(**fields: Any) -> FinishedRequest:
    fields.setdefault("prompt_keys", KEYS)
    fields.setdefault("blocks", len(KEYS))
    fields.setdefault("session_id", "run-1")
    return FinishedRequest(tenant="acme", **fields)


def test_the_engines_word_stands_for_the_clients_silence() -> None:
    d, _ = decider()
    plan = d.decide(finished(tool_call=True))
    assert plan.observation.tool_call_pending is True
    assert d.decide(finished(tool_call=False)).observation.tool_call_pending is False


@pytest.mark.parametrize("client", [True, False])
def test_a_clients_word_wins_over_the_engines(client: bool) -> None:
    d, _ = decider()
    said = CheckpointObservation(tool_call_pending=client)
    plan = d.decide(finished(observation=said, tool_call=not client))
    assert plan.observation.tool_call_pending is client


def test_a_kept_tool_call_turn_asks_for_retention_for_the_prior_then_the_learned_ttl() -> None:
    gaps = ReturnGaps(quantile=0.5, min_samples=3, prior_s=20.0)
    d, clock = decider(gaps=gaps)
    plan = d.decide(finished(tool_call=True))
    assert plan.trigger == "system" and plan.retain_s == 20.0 and plan.retain_session == "run-1"
    for pause in (4.0, 6.0, 8.0):  # the session comes back after each pause
        clock.now += pause
        gap = d.arrived("acme", "run-1")
        assert gap is not None and gap.cls == TOOL_CALL and gap.seconds == pause
        plan = d.decide(finished(tool_call=True))
    assert gaps.samples(TOOL_CALL) == 3
    assert plan.retain_s == 6.0  # the median of the pauses learned


def test_the_ttl_is_bounded_by_max_retain_s_and_zero_retains_nothing() -> None:
    d, _ = decider(gaps=ReturnGaps(prior_s=500.0), max_retain_s=120.0)
    assert d.decide(finished(tool_call=True)).retain_s == 120.0
    d, _ = decider(max_retain_s=0.0)
    assert d.decide(finished(tool_call=True)).retain_s is None


def test_classes_learn_their_own_pauses() -> None:
    gaps = ReturnGaps(min_samples=1)
    d, clock = decider(gaps=gaps)
    d.decide(finished(session_id="tool", tool_call=True))
    d.decide(finished(session_id="human", tool_call=False))
    clock.now += 10.0
    assert d.arrived("acme", "tool").cls == TOOL_CALL  # type: ignore[union-attr]
    clock.now += 200.0
    assert d.arrived("acme", "human").seconds == 210.0  # type: ignore[union-attr]
    assert gaps.samples(TOOL_CALL) == gaps.samples(END_OF_TURN) == 1
    # Sessions are the tenant's: another tenant's "tool" closes no gap.
    assert d.arrived("other", "tool") is None


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_call": False},  # no tool call
        {"tool_call": None},  # no word
        {"tool_call": True, "observation": CheckpointObservation(tool_call_pending=False)},
        {"tool_call": True, "opted_out": True},  # the client asked that nothing be kept
        {"tool_call": True, "session_id": None},  # no session: nothing to release it on
        {"tool_call": True, "prompt_keys": None, "blocks": 0},  # nothing may be kept
    ],
)
def test_no_retention_without_a_kept_tool_call_turn(fields: dict[str, Any]) -> None:
    d, _ = decider()
    assert d.decide(finished(**fields)).retain_s is None


def test_the_clients_own_tool_call_pending_alone_asks_no_retention() -> None:
    # The client's word is evidence (the reply advises kvci.retain); the order is its own to give.
    d, _ = decider()
    plan = d.decide(finished(observation=CheckpointObservation(tool_call_pending=True)))
    assert plan.observation.tool_call_pending is True and plan.retain_s is None


def test_nothing_kept_asks_no_retention() -> None:
    d, _ = decider(system_trigger=False)
    plan = d.decide(finished(tool_call=True))
    assert plan.trigger is None and plan.retain_s is None


def test_an_explicit_keep_of_a_tool_call_turn_is_retained_too() -> None:
    d, _ = decider(system_trigger=False)
    plan = d.decide(finished(tool_call=True, explicit_trigger="agent"))
    assert plan.trigger == "agent" and plan.retain_s == 20.0


def test_without_the_engines_word_every_decision_is_as_before() -> None:
    """The same requests through a decider without return gaps and one with them, the engine
    saying nothing: the same plans, field for field."""
    plain = KeepDecider(ram=ram_policy_for("value"), advisor=advisor(0.6), gate=CacheGate())
    learning, clock = decider()
    requests = [
        finished(),
        finished(observation=CheckpointObservation(tool_call_pending=True)),
        finished(session_id=None),
        finished(opted_out=True),
        finished(explicit_trigger="user", persist=True),
    ]
    for request in requests:
        clock.now += 5.0
        learning.arrived("acme", request.session_id)
        assert dataclasses.asdict(plain.decide(request)) == dataclasses.asdict(
            learning.decide(request))


def test_without_return_gaps_the_engines_word_is_evidence_only() -> None:
    d = KeepDecider(ram=ram_policy_for("value"), advisor=advisor(0.6), gate=CacheGate())
    plan = d.decide(finished(tool_call=True))
    assert plan.observation.tool_call_pending is True and plan.retain_s is None
    assert d.arrived("acme", "run-1") is None
