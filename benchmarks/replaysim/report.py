"""The JSON report of an engine replay: every figure its README section shows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA = "kvci-replay/1"
# The bar: the engine's saved-token ratio (kvci / kvci keeping everything) within this
# relative distance of the simulator's (kvci / LRU) on the same slice, budget and timeline.
TARGET_AGREEMENT = 0.10
# Engine runs, in the order they run: name -> what it is.
RUNS: dict[str, str] = {
    "vllm": "vLLM alone (its prefix cache)",
    "kvci": "kvci, default policy",
    "kvci_keep_all": "kvci keeping everything",
}

_FROZEN = ConfigDict(frozen=True, extra="forbid")
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class RequestSample(BaseModel):
    """One replayed request as the engine answered it."""

    model_config = _FROZEN

    arrival_s: float  # since the run's first request was sent
    prompt_tokens: PositiveInt
    cached_tokens: NonNegativeInt  # RequestOutput.num_cached_tokens: vLLM's and kvci's together
    kvci_tokens: NonNegativeInt  # of those, loaded by kvci (its reply's hit_tokens)
    kept: bool  # kvci kept this request's KV (its reply's tier is not "none")
    ttft_s: float

    @model_validator(mode="after")
    def _parts(self) -> RequestSample:
        if self.kvci_tokens > self.cached_tokens or self.cached_tokens > self.prompt_tokens:
            raise ValueError("kvci_tokens <= cached_tokens <= prompt_tokens must hold")
        return self


def _quantile(values: Sequence[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class EngineRun(BaseModel):
    """One engine's pass over the slice; the totals are derived from ``samples``."""

    model_config = _FROZEN

    name: str
    extra_config: dict[str, Any] | None  # kv_connector_extra_config; None: no connector
    engine_start_s: float
    replay_s: float
    prompt_tokens: NonNegativeInt
    saved_vllm_tokens: NonNegativeInt
    saved_kvci_tokens: NonNegativeInt
    saved_tokens: NonNegativeInt
    requests_with_hit: NonNegativeInt
    kept_requests: NonNegativeInt
    ttft_p50_s: float
    ttft_p90_s: float
    # vllm:kvci_* series at the end of the run (name{labels} -> value); empty without kvci.
    kvci_metrics: dict[str, float]
    samples: tuple[RequestSample, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _totals(self) -> EngineRun:
        if self != EngineRun.of(self.name, self.extra_config, self.engine_start_s, self.replay_s,
                                self.kvci_metrics, self.samples):
            raise ValueError("an engine run's totals must be the ones its samples give")
        return self

    @classmethod
    def of(cls, name: str, extra_config: dict[str, Any] | None, engine_start_s: float,
           replay_s: float, kvci_metrics: dict[str, float],
           samples: Sequence[RequestSample]) -> EngineRun:
        ttft = sorted(s.ttft_s for s in samples)
        kvci = sum(s.kvci_tokens for s in samples)
        cached = sum(s.cached_tokens for s in samples)
        return cls.model_construct(
            name=name, extra_config=extra_config, engine_start_s=engine_start_s, replay_s=replay_s,
            prompt_tokens=sum(s.prompt_tokens for s in samples), saved_vllm_tokens=cached - kvci,
            saved_kvci_tokens=kvci, saved_tokens=cached,
            requests_with_hit=sum(1 for s in samples if s.cached_tokens),
            kept_requests=sum(1 for s in samples if s.kept),
            ttft_p50_s=_quantile(ttft, 0.5), ttft_p90_s=_quantile(ttft, 0.9),
            kvci_metrics=kvci_metrics, samples=tuple(samples))

    @property
    def saved_share(self) -> float:
        return self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class SimulatedPolicy(BaseModel):
    """The simulator's replay of one policy on the slice, retimed as one engine run saw it."""

    model_config = _FROZEN

    policy: str
    timeline: str  # the engine run whose arrival times the simulator replayed
    input_tokens: NonNegativeInt  # in trace tokens (512 per block)
    saved_tokens: NonNegativeInt  # by the modelled vLLM cache (if any) and the tier together
    ram_blocks_written: NonNegativeInt
    admitted_requests: NonNegativeInt

    @property
    def saved_share(self) -> float:
        return self.saved_tokens / self.input_tokens if self.input_tokens else 0.0


class Agreement(BaseModel):
    model_config = _FROZEN

    # None where the denominator saved nothing (no ratio to compare).
    engine_ratio: float | None  # kvci saved / kvci-keeping-everything saved, on the engine
    simulator_ratio: float | None  # kvci saved / lru saved, in the simulator
    relative_gap: float | None  # |engine / simulator - 1|
    agrees: bool  # relative_gap <= TARGET_AGREEMENT
    kvci_not_worse: bool  # engine: kvci saved >= kvci keeping everything saved


def agreement(runs: dict[str, EngineRun], kvci: SimulatedPolicy, lru: SimulatedPolicy) -> Agreement:
    engine = _ratio(runs["kvci"].saved_tokens, runs["kvci_keep_all"].saved_tokens)
    simulated = _ratio(kvci.saved_tokens, lru.saved_tokens)
    gap = None if engine is None or not simulated else abs(engine / simulated - 1.0)
    return Agreement(engine_ratio=engine, simulator_ratio=simulated, relative_gap=gap,
                     agrees=gap is not None and gap <= TARGET_AGREEMENT,
                     kvci_not_worse=runs["kvci"].saved_tokens >= runs["kvci_keep_all"].saved_tokens)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


class ReplayReport(BaseModel):
    model_config = _FROZEN

    report_format: Literal["kvci-replay/1"] = SCHEMA
    command: str
    runtime_s: float
    vllm_version: str
    cpus: PositiveInt
    load_average: tuple[float, float]  # 1-minute load average at the start and at the end
    trace: str
    trace_sha256: str
    requests: PositiveInt
    trace_duration_s: float
    time_scale: float
    budget_fraction: float
    distinct_blocks: PositiveInt
    ram_blocks: PositiveInt
    engine_block_tokens: PositiveInt
    page_bytes: PositiveInt
    ram_bytes: PositiveInt
    engine_blocks: PositiveInt  # num_gpu_blocks_override: vLLM's own KV cache
    mean_request_blocks: float
    max_model_len: PositiveInt
    max_output_tokens: PositiveInt
    model: dict[str, Any]
    runs: dict[str, EngineRun]
    simulated: dict[str, SimulatedPolicy]  # "kvci" and "lru", each on its engine run's timeline
    simulated_all: dict[str, int]  # every sweep policy's saved tokens on the kvci run's timeline
    agreement: Agreement
    # The product's own keep-everything policy (the RAM index with ram_policy lru, checkpoint by
    # checkpoint, as the engine runs it) replayed on the kvci_keep_all run's timeline, and the
    # agreement against it; None in a report written before it was measured.
    simulated_product_lru: SimulatedPolicy | None = None
    product_agreement: Agreement | None = None
    # The simulator's model of vLLM's prefix cache in front of kvci (blocks), its observations in
    # engine tokens; None in a report whose simulator modelled neither.
    simulated_engine_cache_blocks: PositiveInt | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ReplayReport:
        if list(self.runs) != list(RUNS):
            raise ValueError(f"runs must be exactly {list(RUNS)}, in that order")
        if set(self.simulated) != {"kvci", "lru"}:
            raise ValueError("simulated must hold the kvci and lru policies")
        if any(len(run.samples) != self.requests for run in self.runs.values()):
            raise ValueError("every run must replay every request")
        if self.runs["vllm"].saved_kvci_tokens:
            raise ValueError("vLLM alone cannot have kvci hits")
        if self.agreement != agreement(self.runs, self.simulated["kvci"], self.simulated["lru"]):
            raise ValueError("agreement must be the one the runs and the simulation give")
        product = self.simulated_product_lru
        expected = (
            None if product is None else agreement(self.runs, self.simulated["kvci"], product)
        )
        if self.product_agreement != expected:
            raise ValueError("product_agreement must be the one simulated_product_lru gives")
        return self
