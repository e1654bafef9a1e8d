"""The simulator replays the product's keep decision: one trace driven through the policy
simulator's kvci tier (``benchmarks/policysim/kvci_tier.py``) and through the connector's
scheduler (no engine: real vLLM Requests, the real scheduler and RAM index, its prefill timed on
a clock the test moves) asks the same ``KeepDecider`` the same questions and gets the same plans.
A caller that builds what it asks differently (an observation measured otherwise, a lookup
counted otherwise, another session's turn) fails here."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

import kvci_plugin.connector.scheduler as scheduler_module
from benchmarks.policysim.kvci_tier import KVCITier, replay_kvci
from benchmarks.policysim.sessions import RequestContext, SessionTracker, session_contexts
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.policy import FinishedRequest, KeepDecider, KeepOutcome, KeepPlan
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.worthiness import CacheGate

RATE = 8192.0  # tokens a second: a power of two, so each prefill time is exact on both sides
SLOT = 1 << 12
NS = hashlib.sha256(b"parity").digest()


def trace() -> list[TraceRequest]:
    """Sessions keyed by their first two blocks: a first request with no full block (before any
    prefill is timed), extensions that hit, a repeat, one that ends with its first token (its
    prefill is never timed), and a session whose rewrites churn until the cache gate pauses it and
    keeps only the prefix its rewrites kept. Trace time starts at 1 s: the scheduler's clock is
    the test's, and a real one never reads 0."""
    chains: list[tuple[tuple[int, ...], int, int]] = [  # (hash ids, tokens short of full, output)
        ((9,), 300, 50),
        ((1, 2, 3), 10, 200),
        ((1, 2, 3, 4, 5), 100, 200),
        ((7, 8), 0, 1),
        ((1, 2, 3, 4, 5, 6), 1, 200),
        ((7, 8), 0, 200),
        *(((30, 31, 32, 100 * n, 100 * n + 1), 10, 120) for n in range(1, 5)),
        ((30, 31, 32, 400, 401, 402), 10, 120),
    ]
    return [TraceRequest(1000 * (i + 1), len(chain) * BLOCK_TOKENS - short, output, chain)
            for i, (chain, short, output) in enumerate(chains)]


class Recorder:
    """Every question a decider was asked and its answer, and every lookup and outcome told."""

    def __init__(self, decider: KeepDecider) -> None:
        self.asked: list[tuple[FinishedRequest, KeepPlan]] = []
        self.lookups: list[bool] = []
        self.kept: list[bool | None] = []
        decide, learn, looked_up = decider.decide, decider.learn, decider.looked_up

        def recorded_decide(finished: FinishedRequest) -> KeepPlan:
            plan = decide(finished)
            self.asked.append((finished, plan))
            return plan

        def recorded_learn(plan: KeepPlan, outcome: KeepOutcome | None) -> None:
            self.kept.append(None if outcome is None else outcome.kept)
            learn(plan, outcome)

        def recorded_lookup(hit: bool) -> None:
            self.lookups.append(hit)
            looked_up(hit)

        decider.decide, decider.learn, decider.looked_up = (  # type: ignore[method-assign]
            recorded_decide, recorded_learn, recorded_lookup)


def comparable(finished: FinishedRequest, plan: KeepPlan) -> dict[str, Any]:
    """A decision in terms both callers share: keys as positions in the prompt, sessions as
    whether one was named, the gate's word by its rule."""
    keys: Sequence[Hashable] = finished.prompt_keys or ()
    offer = plan.offer
    return {
        "observation": plan.observation.model_dump(),
        "recommendation": plan.recommendation.model_dump(),
        "trigger": plan.trigger,
        "gate": None if plan.gate is None else (plan.gate.allow, plan.gate.rule.value),
        "churn_keep": plan.churn_keep,
        "blocks": plan.blocks,
        "offer": None
        if offer is None
        else (
            list(keys).index(offer.anchor),
            offer.explicit,
            offer.score,
            offer.rebuild_s_per_page,
            offer.pending,
        ),
        "persist": plan.persist,
        "session": finished.session_id is not None,
        "keys": len(keys),
    }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class StepOutput:
    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled
        self.total_num_scheduled_tokens = sum(scheduled.values())


class Output:
    def __init__(self, finished_sending: set[str]) -> None:
        self.finished_sending = finished_sending
        self.kv_connector_worker_meta = None


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self._ids,)


def tokens(chain: Sequence[int], length: int) -> list[int]:
    """A prompt whose 512-token blocks are the chain's hash ids: equal ids, equal blocks."""
    return [block * BLOCK_TOKENS + i + 1 for block in chain for i in range(BLOCK_TOKENS)][:length]


def run_scheduler(requests: list[TraceRequest], contexts: list[RequestContext],
                  clock: Clock) -> tuple[KVCIScheduler, Recorder]:
    """The trace through the connector's scheduler hooks, one request at a time as the simulator
    replays it: lookup, load, a prefill step, a decode step (when it outputs more than its first
    token), its finish, and the store the workers report done."""
    s = KVCIScheduler(
        config=KVCIConfig(ram_bytes=256 * SLOT),
        block_size=BLOCK_TOKENS,
        slot_bytes=SLOT,
        namespace=NS,
        secret=b"s" * 32,
        tp_size=1,
        tenants=TenantResolver(None),
        disk=None,
    )
    recorder = Recorder(s.decider)
    for n, (trace_request, context) in enumerate(zip(requests, contexts)):
        clock.now = trace_request.timestamp_ms / 1000.0
        req_id = f"r{n}"
        kvci: dict[str, Any] = {"tenant": "acme"}
        if context.session_id is not None:
            kvci["session_id"] = context.session_id
        req = Request(
            req_id,
            tokens(trace_request.hash_ids, trace_request.input_length),
            SamplingParams(
                max_tokens=trace_request.output_length,
                extra_args={"kv_transfer_params": {"kvci": kvci}},
            ),
            None,
        )
        block_ids = list(range(1, len(trace_request.hash_ids) + 1))
        hit, _ = s.get_num_new_matched_tokens(req, 0)
        if hit:
            s.update_state_after_alloc(req, Blocks(block_ids), hit)
        computed = trace_request.input_length - hit
        s.build_connector_meta(StepOutput({req_id: computed}))
        req.append_output_token_ids([1] * trace_request.output_length)
        if trace_request.output_length > 1:
            clock.now += computed / RATE
            s.build_connector_meta(StepOutput({req_id: 1}))
        req.num_computed_tokens = trace_request.input_length
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, _ = s.request_finished(req, [block_ids])
        if delay:
            s.build_connector_meta(StepOutput({}))
            s.update_connector_output(Output({req_id}))
    return s, recorder


def lookups_judged(gate: CacheGate) -> tuple[Any, Any]:
    """The lookups and hits the cache gate's hit-rate floor has counted."""
    inputs = next(e.inputs for e in gate.decide().evaluated if e.rule.value == "hit_rate_floor")
    return inputs["lookups"], inputs["hits"]


def test_the_simulator_and_the_scheduler_decide_alike_on_one_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests = trace()
    contexts = session_contexts(requests, SessionTracker(threads=False))
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)  # the scheduler times prefills on it
    tier = KVCITier(256, prefill_tokens_per_second=RATE)
    simulated = Recorder(tier.decider)
    replay_kvci(requests, contexts, tier)
    s, product = run_scheduler(requests, contexts, clock)

    assert len(simulated.asked) == len(product.asked) == len(requests)
    for n, (sim, real) in enumerate(zip(simulated.asked, product.asked)):
        assert comparable(*sim) == comparable(*real), f"request {n} was decided differently"
    assert simulated.lookups == product.lookups
    assert simulated.kept == product.kept
    assert lookups_judged(tier.gate) == lookups_judged(s.cache_gate)
    # The trace reaches what it is built to reach, so the comparison above compares something.
    plans = [plan for _, plan in product.asked]
    assert any(f.history is not None and f.history.turn is not None and f.history.turn.rewrote
               for f, _ in product.asked)
    assert any(plan.churn_keep for plan in plans)
    assert any(plan.observation.cached_tokens for plan in plans)
    assert plans[0].offer is None  # no full block
    assert plans[0].observation.wall_time_s is None  # no prefill timed yet
    assert plans[1].observation.wall_time_s == requests[1].input_length / RATE  # its own, timed
    assert any(product.lookups)
