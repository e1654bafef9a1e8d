"""kvci's RAM tier as the connector runs it, replayed on a trace: the product's code, not a copy.

Per request, in the connector's order (``connector/scheduler.py``): the lookup tells the real
``RAMIndex`` the prompt's keys (``observe_lookup``: the policy learns which remembered contexts
came back) and hits the longest run the index holds, pinned and released as a load is; when the
request finishes, the product's own ``KeepDecider`` (``kvci_plugin.policy.keep_decider``) decides
what to keep, from what the connector measures (its prompt and output, the tokens it found
cached, the whole prompt's prefill at the prefill rate measured as the connector measures it:
the product's ``LoadOrRecompute`` timing the prompts that loaded nothing, each taking its
uncached tokens over the configured rate) and what the real ``RequestHistory`` measures (the
session's turn, the context's observed reuse): the real ``CheckpointAdvisor`` scores, the real
``CacheGate`` may pause the system trigger (a churn pause still offers what the session's
rewrites kept), and the offer the index's policy weighs in ``reserve`` is sighted. Only full
blocks are offered, as the engine keeps them. The policy is the connector's default
(``ValuePolicy``, no settings) unless another is passed.

With an ``EngineView`` (an engine replay's prediction) vLLM's own prefix cache sits in front:
kvci loads only past the blocks it holds, and the observation counts engine tokens.

With ``told`` (one entry per request, in trace order) the observation also carries what the
client said of the turn's end, as a client sends it in ``kvci.observation``:
``tool_call_pending`` True (the run will be back), False, or None (nothing said; the trace says
nothing, so the default run says nothing).

A trace that records how each turn ended (``stop``) gives the engine's own word on it, as the
connector reads it from the output's tool-call markers (``trace.engine_word``): the decider takes
it for ``tool_call_pending`` where the client said nothing, learns each class's return gap, and a
kept tool-call turn is retained for the learned TTL (``KeepPlan.retain_s``) through the product's
``Retentions`` on the same index: its pages pinned until the TTL ends or its session's next
request arrives, within the tenant's fair share, at the connector's default ``max_retain_s``.
A trace without ``stop`` says nothing, and nothing is retained.

A hash id becomes a 16-byte page key; one page = one 512-token block. The entry bound is the
page capacity: a deployment that sizes the tier for N pages lets it hold N checkpoints.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Sequence

from pydantic import JsonValue

from benchmarks.policysim.engine_view import EngineCache, EngineView
from benchmarks.policysim.replay import Tally, account_lookup
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest, engine_word
from benchmarks.policysim.worthiness_admission import TraceClock
from kvci_plugin.policy import (
    FinishedRequest,
    KeepDecider,
    KeepOutcome,
    KeepPlan,
    ReturnGaps,
    TierPolicy,
    ram_policy_for,
)
from kvci_plugin.tiering.load_or_recompute import LoadOrRecompute
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.retention import RetentionRefused, Retentions
from kvci_plugin.tiering.types import DoesNotFitError, NotWorthDisplacingError
from kvci_plugin.worthiness import (
    CacheGate,
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointTier,
    RequestHistory,
)

TENANT = "trace"
# The connector's default bound on retention (``KVCIConfig.max_retain_s``).
MAX_RETAIN_S = 300.0


def page_key(block: int) -> bytes:
    return block.to_bytes(16, "little")


class KVCITier:
    def __init__(
        self,
        capacity_blocks: int,
        *,
        prefill_tokens_per_second: float,
        policy: TierPolicy | None = None,
        name: str | None = None,
        engine: EngineView | None = None,
        told: Sequence[bool | None] | None = None,
    ) -> None:
        ram = ram_policy_for("value")  # the connector's default ram_policy
        self.policy = policy if policy is not None else ram.tier_policy()
        self.name = name or self.policy.name
        self._clock = TraceClock()
        self.index = RAMIndex(
            capacity_blocks, 1, capacity_blocks, policy=self.policy, clock=self._clock
        )
        self.advisor = CheckpointAdvisor()
        self.gate = CacheGate(clock=self._clock, hit_rate_floor=ram.hit_rate_floor)
        self.decider = KeepDecider(
            ram=ram, advisor=self.advisor, gate=self.gate, sight=self.index.sight,
            return_gaps=ReturnGaps(), max_retain_s=MAX_RETAIN_S, clock=self._clock,
        )
        self.retentions = Retentions(self.index, None, clock=self._clock)
        self._words: Counter[str] = Counter()
        self._retained: Counter[str] = Counter()
        self.prefill_tokens_per_second = prefill_tokens_per_second
        self._prefill = LoadOrRecompute()  # the connector's own measure of the prefill rate
        self.history = RequestHistory()
        self.engine = engine
        self._engine_cache = EngineCache(engine) if engine is not None else None
        self._outcomes: Counter[str] = Counter()
        self._recommended: Counter[str] = Counter()
        self._gate_refusals: Counter[str] = Counter()
        self._told = tuple(told) if told is not None else None
        self._steps = 0

    def step(self, request: TraceRequest, context: RequestContext, tally: Tally) -> None:
        """One request: its lookup, then what the connector keeps of it when it finishes."""
        self._clock.now_s = request.timestamp_ms / 1000.0
        self._arrived(context)
        pending = self._pending()
        keys = [page_key(block) for block in request.hash_ids[: request.full_blocks]]
        local = self._engine_cache.lookup(request) if self._engine_cache is not None else 0
        self.index.observe_lookup(keys)
        # As the connector caps it: never every token of the prompt.
        run = min(self.index.longest_prefix(keys, TENANT), request.hit_blocks)
        loaded = max(0, run - local)  # kvci loads only what the engine does not hold
        if loaded:
            self.index.pin(keys[local:run], TENANT)
            self.index.unpin(keys[local:run])
            self.history.record_hit(keys[run - 1])
        account_lookup(tally, request, loaded, 0, local)
        self.decider.looked_up(loaded > 0)
        plan = self.decider.decide(self._finished(request, context, keys, local, loaded, pending))
        self._recommended[plan.recommendation.tier.value] += 1
        if self._engine_cache is not None:
            self._engine_cache.finished(request)
        kept = self._keep(keys, plan, tally)
        self.decider.learn(plan, None if plan.trigger is None else KeepOutcome(kept=kept))

    def _arrived(self, context: RequestContext) -> None:
        """As the connector's step does: retentions past their TTL end, and the session's own end
        with its next request (the pause it closed is learned)."""
        self.retentions.expire()
        if context.session_id is not None:
            self.decider.arrived(TENANT, context.session_id)
            self.retentions.release_session(TENANT, context.session_id)

    def _pending(self) -> bool | None:
        """What this request's client said of its turn's end (None: nothing)."""
        pending = None
        if self._told is not None:
            if self._steps >= len(self._told):
                raise IndexError(
                    f"told covers {len(self._told)} requests; request {self._steps + 1} arrived"
                )
            pending = self._told[self._steps]
        self._steps += 1
        return pending

    def _keep(self, keys: list[bytes], plan: KeepPlan, tally: Tally) -> bool:
        """Carry ``plan`` out on the index, as the connector's manager does; whether it was kept."""
        if not keys:
            self._outcomes["no_full_block"] += 1
            return False
        if plan.gate is None:  # the gate is asked of every request the system trigger offers
            self._outcomes["not_offered"] += 1
            return False
        if not plan.gate.allow:
            self._gate_refusals[plan.gate.rule.value] += 1
            if plan.trigger is None:
                self._outcomes["cache_gate_paused"] += 1
                return False
            self._outcomes["cache_gate_kept_prefix"] += 1
        cid = uuid.uuid4().hex
        try:
            reservation = self.index.reserve(cid, TENANT, keys[: plan.blocks], offer=plan.offer)
        except NotWorthDisplacingError:
            self._outcomes["refused_under_pressure"] += 1
            return False
        except DoesNotFitError:
            self._outcomes["does_not_fit"] += 1
            return False
        if plan.retain_s is not None:
            self._retain(cid, keys[: plan.blocks], plan)
        self.index.commit(cid)
        self.retentions.committed()
        if self.index.keep_resent_prefix(cid, uuid.uuid4().hex):
            self._outcomes["kept_resent_prefix"] += 1
        self._outcomes["kept"] += 1
        tally.admitted_requests += 1
        tally.ram_blocks_written += len(reservation.new_keys)
        return True

    def _retain(self, cid: str, keys: list[bytes], plan: KeepPlan) -> None:
        """The plan's automatic retention, granted as the manager grants ``kvci.retain``."""
        assert plan.retain_s is not None
        try:
            self.retentions.grant(cid, TENANT, keys, plan.retain_s, plan.retain_session)
        except RetentionRefused:
            self._retained["refused"] += 1
            return
        self._retained["granted"] += 1

    def _finished(
        self,
        request: TraceRequest,
        context: RequestContext,
        keys: list[bytes],
        local: int,
        loaded: int,
        pending: bool | None,
    ) -> FinishedRequest:
        """What the connector's scheduler tells the keep decision when the request finishes."""
        if self.engine is None:
            prompt, output, block_tokens = request.input_length, request.output_length, BLOCK_TOKENS
        else:
            prompt, output = self.engine.prompt_tokens(request), self.engine.output_tokens(request)
            block_tokens = self.engine.block_tokens
        computed = prompt - local * block_tokens
        # The connector times a prompt that loaded nothing in the step after its prefill (one
        # that ends with its first token has no such step), and only a block or more of it.
        if not loaded and computed >= block_tokens and output > 1:
            self._prefill.observe_prefill(computed, computed / self.prefill_tokens_per_second)
        cached = local + loaded
        measured = self.history.measure(
            context.session_id, keys, keys[cached - 1] if loaded else None
        )
        return FinishedRequest(
            tenant=TENANT,
            observation=CheckpointObservation(tool_call_pending=pending),
            session_id=context.session_id,
            context_tokens=prompt,
            output_tokens=output,
            cached_tokens=min(cached * block_tokens, prompt),
            rebuild_s=self._prefill.recompute_s(prompt),
            history=measured,
            prompt_keys=keys,
            blocks=len(keys),
            tool_call=self._word(request),
        )

    def _word(self, request: TraceRequest) -> bool | None:
        word = engine_word(request.stop)
        if word is not None:
            self._words["tool_call" if word else "no_tool_call"] += 1
        return word

    def stats(self) -> dict[str, JsonValue]:
        stats: dict[str, JsonValue] = {
            "outcomes": dict(sorted(self._outcomes.items())),
            "recommended": {tier.value: self._recommended[tier.value] for tier in CheckpointTier},
            "gate_refusals": dict(sorted(self._gate_refusals.items())),
            "policy": dataclasses.asdict(self.index.stats().policy),
        }
        if self._words:  # only a trace that says how turns ended has the engine's word
            ended = self.retentions.stats()
            gaps = self.decider.return_gaps
            assert gaps is not None
            stats["engine_word"] = dict(sorted(self._words.items()))
            stats["retentions"] = {
                **dict(sorted(self._retained.items())), "expired": ended.expired,
                "released": ended.released,
                "learned_ttl_s": round(gaps.ttl("tool_call", MAX_RETAIN_S), 3),
            }
        return stats


def replay_kvci(
    requests: list[TraceRequest], contexts: list[RequestContext], tier: KVCITier
) -> Tally:
    if len(requests) != len(contexts):
        raise ValueError(f"{len(requests)} requests but {len(contexts)} contexts")
    tally = Tally()
    for request, context in zip(requests, contexts):
        tier.step(request, context, tally)
    return tally
