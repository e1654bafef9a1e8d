"""kvci's admission: the real ``kvci_plugin.worthiness`` advisor and cache gate, once per request.

The observation holds only what the engine knows when the request finishes: its context and
output sizes, the tokens its lookup found cached, the prefill time that the uncached tokens cost
at a named prefill rate, and its session's history (earlier requests, turns since the context
last changed, recent rewrites). ``context_tokens`` is the input: the rebuild-cost estimate adds
``output_tokens`` to it itself. The turn's prompt is also read as the compiled context it is:
its blocks are the items that went into the context, and those the session's previous prompt did
not hold are novel (``retrieved_items`` / ``novel_items``, what a context bundle of the turn
would derive), so ``retrieval_saturation`` sees whether the context is still taking in new
material or has converged on what it holds. A recommendation of RAM or DISK stores the whole
chain in RAM (and for DISK on disk too: the eligibility gate, deny by default in kvci, is not
modelled, so this measures the worthiness rule alone), unless the cache gate pauses the
autonomous trigger. The gate runs on trace time.

With a ``PressureAwareAdmission`` (``kvci-pressure``), the RAM threshold is the one that rule
holds, moved by the RAM tier's wasted writes (an admitted request's anchor evicted before a hit;
the replay's cache reports evictions to ``evicted``) and missed reuses (a later request extends
one the bar alone held back). A request's anchor is its last full block: the deepest block its
continuation re-sends (the trace's last block is partial unless the input fills it).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from pydantic import JsonValue

from benchmarks.policysim.admission import NOTHING, Admission
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest
from kvci_plugin.policy.admission import PressureAwareAdmission
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
    def __init__(
        self,
        advisor: CheckpointAdvisor,
        *,
        prefill_tokens_per_second: float,
        pressure: PressureAwareAdmission[int] | None = None,
        block_bytes: int = 1,
    ) -> None:
        if not isinstance(advisor, CheckpointAdvisor):
            raise TypeError(f"advisor must be a CheckpointAdvisor, got {type(advisor).__name__}")
        if isinstance(prefill_tokens_per_second, bool) or not isinstance(
            prefill_tokens_per_second, (int, float)
        ):
            raise TypeError(
                "prefill_tokens_per_second must be a number, got "
                f"{type(prefill_tokens_per_second).__name__}"
            )
        if not prefill_tokens_per_second > 0:
            raise ValueError(
                f"prefill_tokens_per_second must be > 0, got {prefill_tokens_per_second!r}"
            )
        if pressure is not None and not isinstance(pressure, PressureAwareAdmission):
            raise TypeError(
                f"pressure must be a PressureAwareAdmission, got {type(pressure).__name__}"
            )
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes must be an int >= 1, got {block_bytes!r}")
        self.advisor = advisor
        self.prefill_tokens_per_second = float(prefill_tokens_per_second)
        self.pressure = pressure
        self.block_bytes = block_bytes
        default = advisor.ram_threshold == DEFAULT_RAM_THRESHOLD
        name = "kvci-threshold" if default else f"kvci-threshold@{advisor.ram_threshold:g}"
        self.name = name if pressure is None else name.replace("-threshold", "") + "-pressure"
        self._clock = TraceClock()
        self.gate = CacheGate(clock=self._clock)
        self._tiers: Counter[str] = Counter()
        self._gate_refusals: Counter[str] = Counter()

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        self._clock.now_s = request.timestamp_ms / 1000.0
        self.gate.record_lookup(hit_tokens > 0)
        if context.rewrote and context.session_id is not None:
            self.gate.record_context_change(context.session_id)
        observation = self.observation(request, context, hit_tokens)
        pressure = self.pressure
        chain = request.hash_ids
        full = request.input_length // BLOCK_TOKENS
        anchor = chain[full - 1] if full else None
        if pressure is None:
            recommendation = self.advisor.recommend(observation)
        else:
            pressure.observe_lookup(chain, -(-hit_tokens // BLOCK_TOKENS))
            recommendation = self.advisor.recommend(observation, ram_threshold=pressure.threshold)
        tier = recommendation.tier
        self._tiers[tier.value] += 1
        admitted = tier is not CheckpointTier.NONE
        if admitted:
            decision = self.gate.decide(context.session_id)
            if not decision.allow:
                self._gate_refusals[decision.rule.value] += 1
                admitted = False
        if pressure is not None and anchor is not None:
            if admitted:
                pressure.admitted(anchor)
            else:
                pressure.declined(anchor, len(chain) * self.block_bytes, recommendation)
        if not admitted:
            return NOTHING
        blocks = len(chain)
        return Admission(blocks, blocks if tier is CheckpointTier.DISK else 0)

    def observation(
        self, request: TraceRequest, context: RequestContext, hit_tokens: int
    ) -> CheckpointObservation:
        return trace_observation(request, context, hit_tokens, self.prefill_tokens_per_second)

    def evicted(self, block: int) -> None:
        """The RAM tier evicted ``block`` (the replay's cache calls this)."""
        if self.pressure is not None:
            self.pressure.evicted((block,))

    def stats(self) -> dict[str, JsonValue]:
        stats: dict[str, JsonValue] = {
            "ram_threshold": self.advisor.ram_threshold,
            "disk_threshold": self.advisor.disk_threshold,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "recommended": {tier.value: self._tiers[tier.value] for tier in CheckpointTier},
            "gate_refusals": dict(sorted(self._gate_refusals.items())),
        }
        if self.pressure is not None:
            stats["pressure"] = dataclasses.asdict(self.pressure.stats())
        return stats


def trace_observation(
    request: TraceRequest,
    context: RequestContext,
    hit_tokens: int,
    prefill_tokens_per_second: float,
) -> CheckpointObservation:
    """What the engine knows about ``request`` when it finishes, as the advisor reads it."""
    return CheckpointObservation(
        context_tokens=request.input_length,
        output_tokens=request.output_length,
        cached_tokens=hit_tokens,
        wall_time_s=(request.input_length - hit_tokens) / prefill_tokens_per_second,
        observed_reuse=context.observed_reuse,
        turns_since_change=context.turns_since_change,
        context_rewrites=context.context_rewrites,
        retrieved_items=None if context.novel_blocks is None else len(request.hash_ids),
        novel_items=context.novel_blocks,
    )
