"""The keep decision without an engine: what a finished request's KV becomes (``KeepDecider``),
and the ``ram_policy`` names it is built from (``ram_policy_for``)."""

from __future__ import annotations

from typing import Any

import pytest
from worthiness.fixed_scorers import FixedScorer

from kvci_plugin.policy import (
    ArmedCheckpoint,
    FinishedRequest,
    KeepDecider,
    KeepOutcome,
    LRUPolicy,
    Offer,
    PressureAwareAdmission,
    ValuePolicy,
    ram_policy_for,
    session_key,
)
from kvci_plugin.policy.keep_decider import arm_binding
from kvci_plugin.worthiness import (
    CacheGate,
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointScorerRegistry,
    CheckpointTier,
    SessionTurn,
)
from kvci_plugin.worthiness.request_history import Measured
from kvci_plugin.worthiness.scorers import CONTEXT_STABILITY, PREDICTED_REUSE, REBUILD_COST

KEYS = ("k1", "k2", "k3", "k4")
# Scores against the advisor's default bars: RAM 0.55, disk 0.75.
DISK, RAM, HELD_BACK = 0.9, 0.6, 0.4


def advisor(value: float, *, veto: bool = False) -> CheckpointAdvisor:
    """Every scorer the disk rule names answers ``value``: DISK at 0.75 and above."""
    return CheckpointAdvisor(
        CheckpointScorerRegistry(
            [
                FixedScorer(name, 1.0, value, veto=veto)
                for name in (REBUILD_COST, PREDICTED_REUSE, CONTEXT_STABILITY)
            ]
        )
    )


def decider(
    value: float = RAM, *, ram: str = "value", veto: bool = False, **settings: Any
) -> tuple[KeepDecider, list[Offer]]:
    """A decider and the offers it sighted."""
    sighted: list[Offer] = []
    settings.setdefault("gate", CacheGate())
    return KeepDecider(
        ram=ram_policy_for(ram), advisor=advisor(value, veto=veto), sight=sighted.append, **settings
    ), sighted


def finished(**fields: Any) -> FinishedRequest:
    fields.setdefault("prompt_keys", KEYS)
    fields.setdefault("blocks", len(KEYS))
    return FinishedRequest(tenant="acme", **fields)


def turn(*, rewrote: bool, kept: int, blocks: int = len(KEYS)) -> Measured:
    return Measured(
        SessionTurn(
            rewrote=rewrote,
            context_rewrites=int(rewrote),
            turns_since_change=0,
            retrieved_items=blocks,
            novel_items=blocks - kept,
        ),
        0,
    )


# ---- the trigger ------------------------------------------------------------------------------


@pytest.mark.parametrize(("ram", "value", "trigger"), [
    ("value", RAM, "system"),
    ("value", HELD_BACK, "system"),  # a value policy weighs what the bar alone held back
    ("lru", HELD_BACK, "system"),
    ("threshold", RAM, "system"),
    ("threshold", HELD_BACK, None),  # under the bar, only what clears it
])
def test_the_system_trigger_offers_what_the_ram_policy_lets_it(
    ram: str, value: float, trigger: str | None
) -> None:
    d, sighted = decider(value, ram=ram)
    plan = d.decide(finished())
    assert plan.trigger == trigger
    assert (plan.gate is not None) == (trigger is not None)
    assert plan.offer is not None and sighted == [plan.offer]  # sighted, kept or not
    assert not plan.offer.explicit and plan.blocks == len(KEYS)


@pytest.mark.parametrize(("value", "veto"), [(HELD_BACK, True), (RAM, True)])
def test_a_veto_blocks_the_system_trigger_under_every_policy(value: float, veto: bool) -> None:
    for ram in ("value", "lru", "threshold"):
        assert decider(value, ram=ram, veto=veto)[0].decide(finished()).trigger is None


def test_an_explicit_trigger_keeps_whatever_the_score_and_asks_no_gate() -> None:
    d, sighted = decider(HELD_BACK, ram="threshold")
    plan = d.decide(finished(explicit_trigger="agent"))
    assert (plan.trigger, plan.gate) == ("agent", None)
    assert plan.offer is not None and plan.offer.explicit and sighted == [plan.offer]


def test_with_the_system_trigger_off_only_an_explicit_one_keeps() -> None:
    d, _ = decider(DISK, system_trigger=False)
    assert d.decide(finished()).trigger is None
    assert d.decide(finished(explicit_trigger="user")).trigger == "user"


def test_an_opted_out_request_offers_nothing_and_leaves_its_sessions_armed_checkpoint() -> None:
    d, sighted = decider(DISK)
    d.arm("acme", "run-1", ArmedCheckpoint("user", True))
    plan = d.decide(finished(session_id="run-1", opted_out=True))
    assert (plan.trigger, plan.offer, plan.armed, plan.gate, plan.persist) == (
        None,
        None,
        None,
        None,
        False,
    )
    assert sighted == []
    assert d.decide(finished(session_id="run-1")).trigger == "user"  # the next one takes it


# ---- armed checkpoints --------------------------------------------------------------------------


def test_an_armed_checkpoint_is_taken_once_by_its_sessions_next_request_with_its_credentials() -> (
    None
):
    d, _ = decider(HELD_BACK, ram="threshold")
    armed = ArmedCheckpoint("agent", True)
    d.arm("acme", "run-1", armed)
    assert d.decide(finished(session_id="run-2")).armed is None  # another session's
    assert (
        d.decide(FinishedRequest(tenant="other", session_id="run-1")).armed is None
    )  # another tenant's
    plan = d.decide(finished(session_id="run-1", session_token="own-jwt",
                             delegation_tokens=("own-delegation",)))
    assert (plan.trigger, plan.armed, plan.persist) == ("agent", armed, True)
    # The arm holds no credential: the request persists with its own.
    assert (plan.session_token, plan.delegation_tokens) == ("own-jwt", ("own-delegation",))
    assert d.decide(finished(session_id="run-1")).trigger is None  # taken


def test_the_requests_own_trigger_and_credentials_win_over_an_armed_one() -> None:
    d, _ = decider(HELD_BACK, ram="threshold")
    d.arm("acme", "run-1", ArmedCheckpoint("agent", False))
    plan = d.decide(finished(session_id="run-1", explicit_trigger="user", session_token="own-jwt"))
    assert (plan.trigger, plan.session_token, plan.delegation_tokens) == ("user", "own-jwt", ())
    assert plan.armed is not None  # consumed all the same


def test_an_arm_bound_to_its_caller_is_taken_only_by_that_callers_request() -> None:
    """In `tenancy: "declared"` anyone may name a tenant and a session: an arm bound to the
    arming caller's credential is left be by another client's request naming them, and taken by
    the next request that carries that credential."""
    d, _ = decider(HELD_BACK, ram="threshold")
    armed = ArmedCheckpoint("user", False, bound_to=arm_binding("armer-jwt"))
    d.arm("acme", "run-1", armed)
    for other in (None, "mallory-jwt"):
        plan = d.decide(finished(session_id="run-1", session_token=other))
        assert (plan.trigger, plan.armed) == (None, None)  # not taken
    assert ("acme", "run-1") in d.armed
    plan = d.decide(finished(session_id="run-1", session_token="armer-jwt"))
    assert (plan.trigger, plan.armed) == ("user", armed)
    assert not d.armed
    assert arm_binding(None) is None and "armer-jwt" not in (arm_binding("armer-jwt") or "")


def test_a_forget_drops_the_checkpoints_its_tenant_armed() -> None:
    d, _ = decider()
    d.arm("acme", "a", ArmedCheckpoint("user", False))
    d.arm("beta", "b", ArmedCheckpoint("user", False))
    d.disarm("acme")
    assert list(d.armed) == [("beta", "b")]


# ---- the cache gate -----------------------------------------------------------------------------


def test_the_kill_switch_pauses_the_system_trigger_but_the_offer_is_still_sighted() -> None:
    d, sighted = decider(DISK, gate=CacheGate(kill_switch=True))
    plan = d.decide(finished())
    assert plan.trigger is None and plan.gate is not None and plan.gate.rule.value == "kill_switch"
    assert plan.churn_keep == 0 and len(sighted) == 1


def test_a_churn_pause_still_keeps_the_prefix_the_sessions_rewrites_kept() -> None:
    gate = CacheGate(churn_threshold=1)
    d, sighted = decider(RAM, gate=gate)
    plan = d.decide(finished(session_id="run-1", history=turn(rewrote=True, kept=2)))
    assert plan.gate is not None and plan.gate.rule.value == "churn"
    assert (plan.trigger, plan.churn_keep, plan.blocks) == ("system", 2, 2)
    # The whole prompt is sighted, then the prefix, anchored at its last block.
    assert [o.anchor for o in sighted] == ["k4", "k2"] and plan.offer == sighted[-1]
    # The rewrite was told to the gate under the tenant's session.
    assert gate.decide(session_key("acme", "run-1")).rule.value == "churn"


def test_a_churning_turn_that_only_extended_its_prompt_is_paused_whole() -> None:
    gate = CacheGate(churn_threshold=1)
    gate.record_context_change(session_key("acme", "run-1"))
    d, _ = decider(RAM, gate=gate)
    plan = d.decide(finished(session_id="run-1", history=turn(rewrote=False, kept=3)))
    assert (plan.trigger, plan.churn_keep, plan.blocks) == (None, 0, len(KEYS))


def test_the_hit_rate_floor_sees_lookups_only_once_a_tier_holds_data() -> None:
    def lookups(d: KeepDecider) -> int:
        assert d.gate is not None
        return int(d.gate.decide().evaluated[1].inputs["lookups"])  # type: ignore[arg-type]

    d, _ = decider()
    d.looked_up(False)
    assert lookups(d) == 0
    d.learn(d.decide(finished()), KeepOutcome(kept=False))
    d.looked_up(False)
    assert lookups(d) == 0
    d.learn(d.decide(finished()), KeepOutcome(kept=True))
    d.looked_up(True)
    assert lookups(d) == 1
    attached, _ = decider(durable_tier=lambda: True)  # a disk tier may hold data already
    attached.looked_up(False)
    assert lookups(attached) == 1


# ---- offers, blocks and the durable copy ---------------------------------------------------------


@pytest.mark.parametrize(("blocks", "anchor"), [(4, "k4"), (6, "k4"), (2, "k2")])
def test_the_offer_is_anchored_at_the_last_full_prompt_block_it_keeps(
    blocks: int, anchor: str
) -> None:
    """Past the prompt (its output filled blocks too) the anchor stays the prompt's last block:
    the deepest one a continuation re-sends."""
    plan = decider()[0].decide(finished(blocks=blocks))
    assert plan.offer is not None and plan.offer.anchor == anchor and plan.blocks == blocks


@pytest.mark.parametrize(
    "fields", [{"prompt_keys": None, "blocks": 0}, {"prompt_keys": (), "blocks": 0}, {"blocks": 0}]
)
def test_a_request_with_nothing_to_keep_offers_nothing(fields: dict[str, Any]) -> None:
    d, sighted = decider()
    plan = d.decide(finished(**fields))
    assert plan.offer is None and sighted == []


@pytest.mark.parametrize(("value", "auto_promote", "fields", "persist"), [
    (DISK, True, {}, True),  # the system trigger promotes a disk recommendation
    (DISK, False, {}, False),
    (RAM, True, {}, False),
    (DISK, True, {"explicit_trigger": "user"}, False),  # an explicit keep asks for disk itself
    (HELD_BACK, False, {"explicit_trigger": "user", "persist": True}, True),
])
def test_the_durable_copy_is_wished_for_as_asked_or_promoted(
    value: float, auto_promote: bool, fields: dict[str, Any], persist: bool
) -> None:
    plan = decider(value, auto_promote=auto_promote)[0].decide(finished(**fields))
    assert plan.persist is persist
    if value == DISK:
        assert plan.recommendation.tier is CheckpointTier.DISK


def test_without_a_gate_or_a_tier_the_decision_still_stands() -> None:
    """LMCache's use: no cache gate, nothing sighted, nothing measured."""
    d = KeepDecider(ram=ram_policy_for("threshold"), advisor=advisor(RAM))
    plan = d.decide(FinishedRequest(tenant="acme"))
    assert (plan.trigger, plan.gate, plan.offer, plan.persist) == ("system", None, None, False)


# ---- the observation -----------------------------------------------------------------------------


def test_the_engines_measures_fill_what_the_client_left_unsaid() -> None:
    client = CheckpointObservation(context_tokens=99, retrieved_items=5, tool_call_pending=True)
    plan = decider()[0].decide(finished(
        observation=client, context_tokens=4096, output_tokens=20, cached_tokens=512, rebuild_s=0.5,
        session_id="run-1", history=turn(rewrote=False, kept=4)))
    obs = plan.observation
    assert (obs.context_tokens, obs.output_tokens, obs.cached_tokens, obs.wall_time_s) == (
        99,
        20,
        512,
        0.5,
    )
    assert obs.tool_call_pending is True and obs.observed_reuse == 0
    # The client's item count stands, and the engine's blocks (another unit) are not mixed in.
    assert (obs.retrieved_items, obs.novel_items) == (5, None)
    assert (obs.context_rewrites, obs.turns_since_change) == (0, 0)


def test_nothing_measured_leaves_the_clients_observation_as_it_is() -> None:
    client = CheckpointObservation(context_tokens=10)
    assert (
        decider()[0].decide(FinishedRequest(tenant="acme", observation=client)).observation
        is client
    )


def test_the_score_reads_the_moving_bar() -> None:
    adv = advisor(0.5)
    bar: PressureAwareAdmission[str] = PressureAwareAdmission.for_advisor(
        adv, capacity_bytes=10_000
    )
    d = KeepDecider(ram=ram_policy_for("threshold"), advisor=adv, bar=bar)
    assert d.ram_threshold == bar.threshold == adv.ram_threshold
    assert d.decide(FinishedRequest(tenant="acme")).trigger is None
    for n in range(5):  # five missed reuses lower the bar to the score
        bar.declined(
            f"t{n}", 1, adv.recommend(CheckpointObservation(), ram_threshold=bar.threshold)
        )
        bar.observe_lookup(["root", f"t{n}", "next"], resident=1)
    assert d.ram_threshold == pytest.approx(0.5)
    assert d.decide(FinishedRequest(tenant="acme")).trigger == "system"


# ---- what the bar learns ------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "fields", "kept", "admitted", "held_back"), [
    (RAM, {}, True, 1, 0),  # the system kept it: the bar admitted it
    (RAM, {}, False, 0, 0),  # offered, not kept: no lesson
    (HELD_BACK, {}, None, 0, 1),  # the bar held it back: remembered
    (HELD_BACK, {"explicit_trigger": "user"}, True, 0, 0),  # not the bar's decision
    (HELD_BACK, {"opted_out": True}, None, 0, 0),  # the client's choice
])
def test_the_bar_learns_only_from_the_system_triggers_own_decisions(
    value: float, fields: dict[str, Any], kept: bool | None, admitted: int, held_back: int
) -> None:
    adv = advisor(value)
    bar: PressureAwareAdmission[str] = PressureAwareAdmission.for_advisor(
        adv, capacity_bytes=10_000
    )
    d = KeepDecider(
        ram=ram_policy_for("threshold"), advisor=adv, gate=CacheGate(), bar=bar, page_bytes=100
    )
    plan = d.decide(finished(**fields))
    d.learn(plan, None if kept is None else KeepOutcome(kept=kept))
    stats = bar.stats()
    assert (stats.tracked_admitted, stats.tracked_held_back) == (admitted, held_back)


def test_pages_evicted_for_a_checkpoint_teach_the_bar_its_wasted_writes() -> None:
    adv = advisor(RAM)
    bar: PressureAwareAdmission[str] = PressureAwareAdmission.for_advisor(
        adv, capacity_bytes=10_000
    )
    d = KeepDecider(ram=ram_policy_for("threshold"), advisor=adv, gate=CacheGate(), bar=bar)
    d.learn(d.decide(finished()), KeepOutcome(kept=True))
    d.learn(
        d.decide(finished(prompt_keys=("x1",), blocks=1)),
        KeepOutcome(kept=True, evicted_pages=("k4",)),
    )
    assert bar.stats().wasted_writes == 1 and bar.threshold > adv.ram_threshold


# ---- ram_policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "under_bar", "floor", "tier"),
    [
        ("value", False, 0.0, ValuePolicy),
        ("lru", False, 0.0, LRUPolicy),
        ("threshold", True, 0.30, LRUPolicy),
    ],
)
def test_each_ram_policy_name_is_resolved_once(
    name: str, under_bar: bool, floor: float, tier: type
) -> None:
    ram = ram_policy_for(name)
    assert (ram.name, ram.under_bar, ram.hit_rate_floor) == (name, under_bar, floor)
    assert isinstance(ram.tier_policy(), tier)


def test_an_unknown_ram_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="ram_policy must be one of value, lru, threshold, not 'fifo'"
    ):
        ram_policy_for("fifo")
