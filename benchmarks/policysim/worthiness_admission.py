"""kvci's admission: the real ``kvci_plugin.worthiness`` advisor and cache gate, once per request.

The observation holds only what the engine knows when the request finishes: its context and
output sizes, the tokens its lookup found cached, the prefill time that the uncached tokens
cost at a named prefill rate, and its session's history (earlier requests, turns since the
context last changed, recent rewrites). ``context_tokens`` is the input: the rebuild-cost
estimate adds ``output_tokens`` to it itself. A recommendation of RAM or DISK stores the whole
chain in RAM (and for DISK on disk too: the eligibility gate, deny by default in kvci, is not
modelled, so this measures the worthiness rule alone), unless the cache gate pauses the
autonomous trigger. The gate runs on trace time.
"""

from __future__ import annotations

from collections import Counter

from pydantic import JsonValue

from benchmarks.policysim.admission import NOTHING, Admission
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest
from kvci_plugin.worthiness import (
    DEFAULT_RAM_THRESHOLD,
    CacheGate,
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointTier,
)


class TraceClock:
    """Seconds of trace time, advanced by the replay; the cache gate's clock."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class WorthinessAdmission:
    def __init__(self, advisor: CheckpointAdvisor, *, prefill_tokens_per_second: float) -> None:
        if not isinstance(advisor, CheckpointAdvisor):
            raise TypeError(f"advisor must be a CheckpointAdvisor, got {type(advisor).__name__}")
        if isinstance(prefill_tokens_per_second, bool) or not isinstance(prefill_tokens_per_second, (int, float)):
            raise TypeError(f"prefill_tokens_per_second must be a number, got {type(prefill_tokens_per_second).__name__}")
        if not prefill_tokens_per_second > 0:
            raise ValueError(f"prefill_tokens_per_second must be > 0, got {prefill_tokens_per_second!r}")
        self.advisor = advisor
        self.prefill_tokens_per_second = float(prefill_tokens_per_second)
        default = advisor.ram_threshold == DEFAULT_RAM_THRESHOLD
        self.name = "kvci" if default else f"kvci@{advisor.ram_threshold:g}"
        self._clock = TraceClock()
        self.gate = CacheGate(clock=self._clock)
        self._tiers: Counter[str] = Counter()
        self._gate_refusals: Counter[str] = Counter()

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        self._clock.now_s = request.timestamp_ms / 1000.0
        self.gate.record_lookup(hit_tokens > 0)
        if context.rewrote and context.session_id is not None:
            self.gate.record_context_change(context.session_id)
        observation = CheckpointObservation(
            context_tokens=request.input_length,
            output_tokens=request.output_length,
            cached_tokens=hit_tokens,
            wall_time_s=(request.input_length - hit_tokens) / self.prefill_tokens_per_second,
            observed_reuse=context.observed_reuse,
            turns_since_change=context.turns_since_change,
            context_rewrites=context.context_rewrites,
        )
        tier = self.advisor.recommend(observation).tier
        self._tiers[tier.value] += 1
        if tier is CheckpointTier.NONE:
            return NOTHING
        decision = self.gate.decide(context.session_id)
        if not decision.allow:
            self._gate_refusals[decision.rule.value] += 1
            return NOTHING
        blocks = len(request.hash_ids)
        return Admission(blocks, blocks if tier is CheckpointTier.DISK else 0)

    def stats(self) -> dict[str, JsonValue]:
        return {
            "ram_threshold": self.advisor.ram_threshold,
            "disk_threshold": self.advisor.disk_threshold,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "recommended": {tier.value: self._tiers[tier.value] for tier in CheckpointTier},
            "gate_refusals": dict(sorted(self._gate_refusals.items())),
        }
