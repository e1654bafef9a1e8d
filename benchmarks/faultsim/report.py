"""The JSON report of a fault replay: every figure its README section shows, derived from the
per-request samples each engine run recorded."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA = "kvci-fault-replay/1"
PHASES: dict[str, str] = {
    "before": "before the fault",
    "during": "during the fault",
    "after": "after the dependency answers again",
}
Phase = Literal["before", "during", "after"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
NonNegativeInt = Annotated[int, Field(ge=0)]


class Sample(BaseModel):
    """One measured request as one engine answered it (times in seconds since the run's
    measured start)."""

    model_config = _FROZEN

    index: NonNegativeInt  # in the measured slice: the same request on every engine
    # By the fault run's send time; None in the anchor's and the floor's runs, whose phases are
    # each fault run's (the same requests).
    phase: Phase | None = None
    due_s: float  # when the schedule sends it
    sent_s: float | None  # None: never sent (the engine had died)
    ttft_s: float | None  # None: no token came back
    prompt_tokens: NonNegativeInt
    cached_tokens: NonNegativeInt  # RequestOutput.num_cached_tokens: vLLM's and kvci's together
    kvci_tokens: NonNegativeInt  # of those, loaded by kvci (its reply's hit_tokens)
    hit_tier: str | None  # kvci's reply: where its hit came from (None: no kvci hit)
    failed: bool  # no normal finish: an error, an abort, or never answered
    kvci_error: str | None = None  # kvci's reply carried an error
    persist: str | None = None  # kvci's reply: the persist's status
    mismatch: bool | None = None  # greedy output differs from the no-connector run's
    worst_step_s: float = 0.0  # longest `llm_engine.step()` call while it was in flight
    steps: NonNegativeInt = 0


def step_phase(
    start: float, seconds: float, injected: float | None, answered: float | None
) -> Phase:
    """The phase of a ``step()`` call: one that ended before the fault began is before it, one that
    overlaps the fault window (from going down to answering again) is the fault's."""
    if injected is None or start + seconds <= injected:
        return "before"
    if answered is None or start < answered:
        return "during"
    return "after"


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class PhaseStats(BaseModel):
    """One engine's requests of one phase."""

    model_config = _FROZEN

    requests: NonNegativeInt
    failed: NonNegativeInt
    kvci_errors: NonNegativeInt
    mismatches: NonNegativeInt
    compared: NonNegativeInt  # requests whose output was compared with the no-connector run's
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    prompt_tokens: NonNegativeInt
    saved_tokens: NonNegativeInt  # every source
    saved_disk_tokens: NonNegativeInt  # loaded from kvci's disk tier
    saved_ram_tokens: NonNegativeInt  # loaded from kvci's RAM tier
    saved_vllm_tokens: NonNegativeInt  # vLLM's own prefix cache
    disk_hits: NonNegativeInt
    # Of the `step()` calls in the phase's time window (a call that overlaps the fault window is
    # the fault's): the longest, and how many.
    worst_step_s: float | None
    steps: NonNegativeInt
    persist: dict[str, int]  # kvci's persist statuses, by status

    @classmethod
    def of(cls, samples: Sequence[Sample], steps: Sequence[tuple[float, float]]) -> PhaseStats:
        ttfts = [s.ttft_s for s in samples if s.ttft_s is not None and not s.failed]
        kvci = lambda tier: sum(s.kvci_tokens for s in samples if s.hit_tier == tier)  # noqa: E731
        return cls(
            requests=len(samples), failed=sum(s.failed for s in samples),
            kvci_errors=sum(s.kvci_error is not None for s in samples),
            mismatches=sum(bool(s.mismatch) for s in samples),
            compared=sum(s.mismatch is not None for s in samples),
            ttft_p50_s=quantile(ttfts, 0.5), ttft_p90_s=quantile(ttfts, 0.9),
            prompt_tokens=sum(s.prompt_tokens for s in samples),
            saved_tokens=sum(s.cached_tokens for s in samples),
            saved_disk_tokens=kvci("disk"), saved_ram_tokens=kvci("ram"),
            saved_vllm_tokens=sum(s.cached_tokens - s.kvci_tokens for s in samples),
            disk_hits=sum(s.hit_tier == "disk" and s.kvci_tokens > 0 for s in samples),
            worst_step_s=max((duration for _, duration in steps), default=None), steps=len(steps),
            persist=dict(sorted(Counter(s.persist for s in samples if s.persist).items())))


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


class PhaseView(BaseModel):
    """One phase of a fault run beside the anchor and the floor on the same requests."""

    model_config = _FROZEN

    kvci: PhaseStats
    anchor: PhaseStats  # kvci with no disk tier, the same requests
    floor: PhaseStats  # no connector, no prefix cache: every prompt recomputed
    ttft_p50_vs_anchor: float | None
    ttft_p90_vs_anchor: float | None
    worst_step_vs_anchor: float | None
    ttft_p50_vs_floor: float | None

    @classmethod
    def of(cls, kvci: PhaseStats, anchor: PhaseStats, floor: PhaseStats) -> PhaseView:
        return cls(kvci=kvci, anchor=anchor, floor=floor,
                   ttft_p50_vs_anchor=ratio(kvci.ttft_p50_s, anchor.ttft_p50_s),
                   ttft_p90_vs_anchor=ratio(kvci.ttft_p90_s, anchor.ttft_p90_s),
                   worst_step_vs_anchor=ratio(kvci.worst_step_s, anchor.worst_step_s),
                   ttft_p50_vs_floor=ratio(kvci.ttft_p50_s, floor.ttft_p50_s))


class LogLine(BaseModel):
    """A line the engine (or kvci) wrote to stderr during the run, and how often."""

    model_config = _FROZEN

    line: str
    count: int


class EngineRun(BaseModel):
    """One engine's pass: the warm-up slice (not measured), then the measured one."""

    model_config = _FROZEN

    name: str
    extra_config: dict[str, Any] | None  # kv_connector_extra_config; None: no connector
    engine_start_s: float | None  # None: it did not start
    warm_requests: NonNegativeInt
    warm_s: float
    measured_s: float
    engine_died: bool
    hung: bool  # a step outlasted --hang-s and the benchmark killed the engine's core
    died_at_s: float | None  # since the measured start (None: alive, or died before it)
    error: str | None
    log_lines: list[LogLine]  # kvci's lines and every error / traceback line of the run
    kvci_metrics: dict[str, float]  # vllm:kvci_* series: counters as this run's increase
    samples: list[Sample]
    # Every `llm_engine.step()` call of the measured slice: (start since its start, seconds).
    steps: list[tuple[float, float]]

    @property
    def failed(self) -> int:
        return sum(s.failed for s in self.samples)


class Recovery(BaseModel):
    """How the disk tier came back after the dependency answered again."""

    model_config = _FROZEN

    first_disk_hit_s: float | None  # dependency answering -> first request served from disk sent
    requests_before_first_disk_hit: int | None  # requests sent in between (none from disk)
    disk_hits_during: NonNegativeInt  # requests served from disk while the fault held


class FaultRun(BaseModel):
    model_config = _FROZEN

    fault: str
    description: str
    injected_at_s: float | None  # since the measured start
    restored_at_s: float | None
    answered_at_s: float | None
    fault_error: str | None  # applying or undoing the fault failed
    terminated_backends: NonNegativeInt
    run: EngineRun
    phases: dict[str, PhaseView]
    recovery: Recovery


class FaultReplayReport(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    report_format: Literal["kvci-fault-replay/1"] = SCHEMA
    command: str
    runtime_s: float
    vllm_version: str
    cpus: int
    load_average: tuple[float, float]
    trace: str
    trace_sha256: str
    workload: dict[str, Any]  # how the slice was chosen and scaled, its sizes
    model: dict[str, Any]
    settings: dict[str, Any]  # pacing, fault window, RAM and engine sizes, kvci's timeouts
    containment_in_tree: dict[str, bool]  # what this tree's kvci has of the containment
    floor: EngineRun  # no connector, no prefix cache
    anchor: EngineRun  # kvci with no disk tier
    faults: dict[str, FaultRun]
