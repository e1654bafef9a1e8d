"""The keep decision: what becomes of a finished request's KV, decided in one place.

The connector's scheduler (``request_finished``), the policy simulator's kvci tier
(``benchmarks/policysim/kvci_tier.py``) and the LMCache admission all ask a ``KeepDecider``, so
the simulator replays the product by construction. From what the client asked and the engine
measured (a ``FinishedRequest``) it builds the observation and scores it, then plans the keep (a
``KeepPlan``): the trigger (the client's, a checkpoint armed for the session, or the system's
when the RAM policy offers the request), the cache gate's pause (a churn pause still offers the
prefix the session's rewrites kept), the offer the tier policy weighs (sighted whether kept or
not), how many leading blocks to keep, and whether to ask the gate for a durable copy. The caller
carries the plan out on its own tiers and tells the decider what came of it (``learn``): the
hit-rate floor starts judging once anything is kept, and the pressure bar learns its wasted
writes and missed reuses. Nothing here knows vLLM.

The engine's own word on the turn's end (``FinishedRequest.tool_call``, read from the output ids
by ``kvci_plugin.request.tool_calls``) stands for the client's ``tool_call_pending`` when the
client said nothing (a client's word wins), so the tier policy's classes learn from it. With a
``ReturnGaps`` the decider learns each class's pause (a session's finished turn to its next
request, told by ``arrived``), and a kept turn that the engine saw end on a tool call asks for
automatic retention (``KeepPlan.retain_s``): exempt from eviction for the learned TTL, bounded by
``max_retain_s``, or until the session's next request. Without the engine's word every decision
is what it was without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvci_plugin.policy.admission import PressureAwareAdmission
from kvci_plugin.policy.offer import Offer, offer_for
from kvci_plugin.policy.ram_policy import RAMPolicy
from kvci_plugin.policy.return_gaps import TOOL_CALL, Gap, ReturnGaps, gap_class
from kvci_plugin.worthiness import (
    MAX_TRACKED,
    CacheGate,
    CacheGateDecision,
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointRecommendation,
    CheckpointTier,
    RebuildCostModel,
    churn_keeps,
)
from kvci_plugin.worthiness.request_history import Measured

SYSTEM = "system"


def session_key(tenant: str, session_id: str) -> str:
    """Sessions are named by their clients: two tenants may both name one "run-1"."""
    return f"{tenant}\x1f{session_id}"


@dataclass(frozen=True)
class ArmedCheckpoint:
    """A checkpoint_now from the control surface: the session's next finished request keeps its
    KV with this trigger (a finished request's blocks are already freed, so "now" means at the end
    of the session's current or next turn). It holds no credential: the request that takes it
    persists with its own (a later client never acts under the armer's authority)."""

    trigger: str
    persist: bool
    # ``arm_binding`` of the arming caller's session credential: only a finished request that
    # carries that same credential takes the arm (another client naming the same tenant and
    # session leaves it be). None: unbound, taken by the session's next request (an arm by a
    # caller that presented no credential).
    bound_to: str | None = None


def arm_binding(session_token: str | None) -> str | None:
    """What binds an arm to the caller that armed it: a SHA-256 of its session credential (the
    credential itself is never kept for this); None without one."""
    if session_token is None:
        return None
    return hashlib.sha256(session_token.encode()).hexdigest()


def _takes(armed: ArmedCheckpoint, finished: FinishedRequest) -> bool:
    """Whether ``finished`` was sent by the caller that armed ``armed``."""
    if armed.bound_to is None:
        return True
    mine = arm_binding(finished.session_token)
    return mine is not None and hmac.compare_digest(mine, armed.bound_to)


@dataclass(frozen=True)
class FinishedRequest:
    """A finished request as the keep decision reads it: what its client asked and said, and what
    the engine measured. A measurement left None was not measured: the observation keeps the
    client's own field then (or none)."""

    tenant: str
    # The client's observation fields (empty when it sent none); its own fields stand.
    observation: CheckpointObservation = field(default_factory=CheckpointObservation)
    session_id: str | None = None  # as the client named it: the decider scopes it to the tenant
    explicit_trigger: str | None = None  # "user" or "agent" when the client asked to keep
    persist: bool = False
    opted_out: bool = False  # the client asked that nothing of it be kept
    session_token: str | None = None
    delegation_tokens: tuple[str, ...] = ()
    context_tokens: int | None = None  # the prompt (the rebuild estimate adds the output itself)
    output_tokens: int | None = None
    cached_tokens: int | None = None
    # Rebuilding the whole prompt at the engine's measured prefill rate; None: not measured yet.
    rebuild_s: float | None = None
    # The request history's measure of it (session turn, observed reuse); None: not keyable.
    history: Measured | None = None
    # The prompt's full-block keys when its KV may be kept (None: it may not), and how many
    # leading blocks of the request hold KV that could be kept (may pass the prompt's).
    prompt_keys: Sequence[Hashable] | None = None
    blocks: int = 0
    # The engine's word on the turn's end, from its output ids: True, it ended on a tool call;
    # False, it did not; None, not known (no markers, constrained output). A client's
    # ``tool_call_pending`` wins over it.
    tool_call: bool | None = None


@dataclass(frozen=True)
class KeepPlan:
    """What to keep of one finished request, for the caller to carry out."""

    observation: CheckpointObservation  # the client's fields completed by the engine's
    recommendation: CheckpointRecommendation
    # Who keeps the KV: "user" / "agent" (asked, or armed for the session) or "system"; None:
    # nothing is kept.
    trigger: str | None
    armed: ArmedCheckpoint | None  # the session's armed checkpoint, consumed by this request
    gate: CacheGateDecision | None  # the cache gate's word, when the system trigger asked it
    churn_keep: int  # > 0: a churn pause still offers this many leading blocks
    blocks: int  # leading blocks to keep
    offer: Offer | None  # what the tier policy weighed; None: the request made no offer
    persist: bool  # ask the eligibility gate for a durable copy
    session_token: str | None
    delegation_tokens: tuple[str, ...]
    opted_out: bool
    # Automatic retention: keep the checkpoint exempt from eviction this many seconds, or until
    # its session's next request (``retain_session`` names it); None: none asked. A client's own
    # ``kvci.retain`` is an order that replaces it.
    retain_s: float | None = None
    retain_session: str | None = None


@dataclass(frozen=True)
class KeepOutcome:
    """What the caller's tier did with a plan's checkpoint."""

    kept: bool  # the tier took it (its copy may still be running)
    # Pages that left the tier to make room for it: what the pressure bar learns wasted writes from.
    evicted_pages: tuple[Hashable, ...] = ()


class KeepDecider:
    """Not thread-safe: ``arm`` and ``disarm`` come from the control surface's thread, so the
    caller serialises them with ``decide`` under one lock (the scheduler's manager lock)."""

    def __init__(
        self,
        *,
        ram: RAMPolicy,
        advisor: CheckpointAdvisor,
        gate: CacheGate | None = None,
        sight: Callable[[Offer], None] | None = None,
        bar: PressureAwareAdmission[Any] | None = None,
        rebuild: RebuildCostModel | None = None,
        system_trigger: bool = True,
        auto_promote: bool = False,
        durable_tier: Callable[[], bool] = lambda: False,
        page_bytes: int = 1,
        return_gaps: ReturnGaps | None = None,
        max_retain_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``gate`` None: nothing pauses the system trigger. ``sight``: tells the RAM tier's policy
        of every offer (None: no tier to tell). ``bar``: the system trigger's RAM bar, moved by the
        tier's pressure (None: the advisor's own threshold). ``durable_tier``: whether a tier that
        may hold data before this decider kept anything is attached now (a disk tier may attach
        late). ``page_bytes``: the size the bar counts a block at. ``return_gaps``: learns the
        pauses after tool-call and end-of-turn turns, whose tool-call TTL (at most
        ``max_retain_s``, 0: none) automatic retention asks for (None: no automatic retention);
        ``clock``: the time the pauses are measured in."""
        self.ram = ram
        self.advisor = advisor
        self.gate = gate
        self.bar = bar
        self.rebuild = rebuild if rebuild is not None else RebuildCostModel()
        self.system_trigger = system_trigger
        self.auto_promote = auto_promote
        self.durable_tier = durable_tier
        self.page_bytes = page_bytes
        self._sight = sight
        # Sessions asked to checkpoint from the control surface, by (tenant, session id): applied
        # to their next finished request.
        self.armed: OrderedDict[tuple[str, str], ArmedCheckpoint] = OrderedDict()
        self._kept_any = False  # whether any checkpoint was ever kept (the hit-rate floor's start)
        self.return_gaps = return_gaps
        self.max_retain_s = max_retain_s
        self._clock = clock

    @property
    def ram_threshold(self) -> float:
        """The RAM threshold requests are scored at now."""
        return self.bar.threshold if self.bar is not None else self.advisor.ram_threshold

    def arm(self, tenant: str, session_id: str, armed: ArmedCheckpoint) -> None:
        """Keep the KV of this session's next finished request (the caller holds its lock)."""
        self.armed[(tenant, session_id)] = armed
        while len(self.armed) > MAX_TRACKED:  # bounded as the request history's tables are
            self.armed.popitem(last=False)

    def disarm(self, tenant: str) -> None:
        """A forget: the checkpoints ``tenant`` armed go with it."""
        for key in [key for key in self.armed if key[0] == tenant]:
            del self.armed[key]

    def arrived(self, tenant: str, session_id: str | None) -> Gap | None:
        """A request of ``session_id`` arrived: the pause since its session's last finished turn
        is learned (the caller ends the session's retentions itself). Sessions are the clients'
        ids: a request without one teaches nothing and is retained only until its TTL."""
        if self.return_gaps is None or session_id is None:
            return None
        return self.return_gaps.arrived(session_key(tenant, session_id), self._clock())

    def looked_up(self, hit: bool) -> None:
        """A keyable request's lookup, told when it finishes: what the hit-rate floor judges."""
        # Before anything was kept every lookup misses: that says nothing about whether writes
        # pay back, so the floor only sees lookups once a tier holds data.
        if self.gate is not None and (self._kept_any or self.durable_tier()):
            self.gate.record_lookup(hit)

    def decide(self, finished: FinishedRequest) -> KeepPlan:
        """Score ``finished`` and plan what of it to keep; sights its offer."""
        observation = self._observe(finished)
        rec = self.advisor.recommend(observation, ram_threshold=self.ram_threshold)
        trigger, armed = self._asked(finished)
        gate, keep = None, 0
        if trigger is None and self._system_offers(finished, rec):
            gate, keep = self._gate(finished)
            if gate is None or gate.allow or keep:
                trigger = SYSTEM
        offer, blocks = self._offer(finished, observation, rec, trigger, keep)
        persist = finished.persist or (armed is not None and armed.persist) or (
            trigger == SYSTEM and self.auto_promote and rec.tier is CheckpointTier.DISK)
        token, delegations = finished.session_token, finished.delegation_tokens
        retain_s = self._pause(finished, observation, trigger, blocks)
        return KeepPlan(
            observation=observation, recommendation=rec, trigger=trigger, armed=armed, gate=gate,
            churn_keep=keep, blocks=blocks, offer=offer, persist=persist, session_token=token,
            delegation_tokens=tuple(delegations), opted_out=finished.opted_out,
            retain_s=retain_s, retain_session=None if retain_s is None else finished.session_id)

    def learn(self, plan: KeepPlan, outcome: KeepOutcome | None) -> None:
        """What came of ``plan`` (None: nothing was asked of a tier)."""
        if outcome is not None and outcome.kept:
            self._kept_any = True
        bar = self.bar
        if bar is None:
            return
        if outcome is not None and outcome.evicted_pages:
            bar.evicted(outcome.evicted_pages)
        # An opted-out request made no offer: the client's choice, not the bar's, is no lesson.
        if plan.offer is not None:
            self._teach_bar(bar, plan, outcome)

    def _pause(self, finished: FinishedRequest, observation: CheckpointObservation,
               trigger: str | None, blocks: int) -> float | None:
        """Remember the turn's end for the pause after it; the automatic retention's TTL when
        the engine saw a tool call the client did not deny and something is kept (None: none)."""
        gaps = self.return_gaps
        if gaps is None or finished.session_id is None:
            return None
        word = observation.tool_call_pending
        gaps.finished(session_key(finished.tenant, finished.session_id), gap_class(word),
                      self._clock())
        if (finished.tool_call is not True or word is not True or trigger is None or not blocks
                or finished.opted_out):
            return None
        ttl = gaps.ttl(TOOL_CALL, self.max_retain_s)
        return ttl if ttl > 0 else None

    def _system_offers(self, finished: FinishedRequest, rec: CheckpointRecommendation) -> bool:
        """Whether the system trigger offers this request (a client's 'never' stands)."""
        return not finished.opted_out and self.system_trigger and self.ram.system_offers(rec)

    def _observe(self, finished: FinishedRequest) -> CheckpointObservation:
        """The client's observation completed by what the engine measured (the client's fields
        stand); a turn that rewrote its session's context is told to the cache gate."""
        obs = finished.observation
        measured: dict[str, Any] = {
            "context_tokens": finished.context_tokens, "output_tokens": finished.output_tokens,
            "cached_tokens": finished.cached_tokens, "wall_time_s": finished.rebuild_s,
        }
        history = finished.history
        if history is not None:
            measured["observed_reuse"] = history.observed_reuse
            turn = history.turn
            if turn is not None:
                if turn.rewrote and self.gate is not None and finished.session_id is not None:
                    self.gate.record_context_change(
                        session_key(finished.tenant, finished.session_id))
                measured.update(context_rewrites=turn.context_rewrites,
                                turns_since_change=turn.turns_since_change)
                # The client's own item counts stand; the engine's blocks are another unit.
                if obs.retrieved_items is None and obs.novel_items is None:
                    measured.update(retrieved_items=turn.retrieved_items,
                                    novel_items=turn.novel_items)
        # The engine's word on the turn's end stands in for the client's when it said none.
        measured["tool_call_pending"] = finished.tool_call
        update = {k: v for k, v in measured.items() if v is not None and getattr(obs, k) is None}
        return obs.model_copy(update=update) if update else obs

    def _asked(self, finished: FinishedRequest) -> tuple[str | None, ArmedCheckpoint | None]:
        """The trigger the client or its session's armed checkpoint asks for. An opted-out
        request leaves its session's armed checkpoint to the next request."""
        trigger = finished.explicit_trigger
        if finished.session_id is None or finished.opted_out:
            return trigger, None
        armed = self.armed.get((finished.tenant, finished.session_id))
        if armed is not None and not _takes(armed, finished):
            armed = None  # another caller's request: the arm waits for its own caller's
        elif armed is not None:
            del self.armed[(finished.tenant, finished.session_id)]
        if trigger is None and armed is not None:
            trigger = armed.trigger
        return trigger, armed

    def _gate(self, finished: FinishedRequest) -> tuple[CacheGateDecision | None, int]:
        """The cache gate's word on the system trigger, and how many leading blocks a churn
        pause still offers (0: none)."""
        if self.gate is None:
            return None, 0
        session = session_key(finished.tenant, finished.session_id) if finished.session_id else None
        decision = self.gate.decide(session)
        turn = finished.history.turn if finished.history is not None else None
        return decision, churn_keeps(decision, turn)

    def _offer(self, finished: FinishedRequest, observation: CheckpointObservation,
               rec: CheckpointRecommendation, trigger: str | None,
               keep: int) -> tuple[Offer | None, int]:
        """The offer the tier policy weighs, sighted kept or not, and the blocks to keep."""
        keys, blocks = finished.prompt_keys, finished.blocks
        if not keys or not blocks or finished.opted_out:
            return None, blocks
        # Anchored where the bar anchors: the prompt's last full block, which a continuation
        # re-sends.
        offer = offer_for(rec, observation, anchor=keys[min(blocks, len(keys)) - 1],
                          explicit=trigger not in (None, SYSTEM), pages=blocks,
                          rebuild=self.rebuild)
        self._tell(offer)
        if keep and keep < blocks:
            # The prefix the session's rewrites kept, weighed per page as the whole prompt.
            blocks = keep
            offer = dataclasses.replace(offer, anchor=keys[blocks - 1])
            self._tell(offer)
        return offer, blocks

    def _tell(self, offer: Offer) -> None:
        if self._sight is not None:
            self._sight(offer)

    def _teach_bar(self, bar: PressureAwareAdmission[Any], plan: KeepPlan,
                   outcome: KeepOutcome | None) -> None:
        """Tell the bar whether the system trigger kept this request or left it. An explicit
        checkpoint is not the bar's decision: it teaches the bar nothing but its evictions."""
        assert plan.offer is not None
        # The anchor is the deepest block a continuation re-sends: the prompt's last full one (a
        # repeat re-sends only the prompt, a next turn may tokenize the output differently).
        anchor = plan.offer.anchor
        if plan.trigger == SYSTEM and outcome is not None and outcome.kept:
            bar.admitted(anchor)
        elif plan.trigger is None:
            bar.declined(anchor, plan.blocks * self.page_bytes, plan.recommendation)
