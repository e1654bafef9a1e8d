"""The JSON report of a sweep: every figure the table, the plot and the results README show."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from benchmarks.policysim.belady_bound import NAME as OFFLINE_BOUND
from benchmarks.policysim.follow_up import FollowUpTable
from benchmarks.policysim.model_shape import ModelShape
from benchmarks.policysim.replay import Tally

SCHEMA = "kvci-policy-sim/3"
GB = 1_000_000_000
BASELINE = "lru"
# The policy the targets are for: kvci as a user who sets nothing gets it.
TARGET_POLICY = "kvci"
# baseline: what others ship (the best online figure is taken over these); kvci: kvci's own;
# control: a yardstick tied to a kvci policy; bound: reads the future.
Role = Literal["baseline", "kvci", "control", "bound"]


@dataclass(frozen=True, slots=True)
class BudgetTarget:
    """Issue 18's target for ``TARGET_POLICY`` at one RAM budget, against store-everything LRU."""

    budget_fraction: float
    saved_ratio: float
    # LRU bytes written / the policy's; None: no write target at this budget.
    write_reduction: float | None


TARGETS = (
    BudgetTarget(0.01, 1.9, 3.0),
    BudgetTarget(0.025, 1.7, 3.0),
    BudgetTarget(0.05, 1.2, None),
    BudgetTarget(0.10, 1.05, None),
    BudgetTarget(0.25, 1.0, None),
)


def target_for(budget_fraction: float) -> BudgetTarget | None:
    for target in TARGETS:
        if math.isclose(target.budget_fraction, budget_fraction):
            return target
    return None

_FROZEN = ConfigDict(frozen=True, extra="forbid")
NonNegativeInt = Annotated[int, Field(ge=0)]


class TraceSummary(BaseModel):
    model_config = _FROZEN

    path: str
    sha256: str
    requests: NonNegativeInt
    distinct_blocks: NonNegativeInt
    input_tokens: NonNegativeInt
    output_tokens: NonNegativeInt
    duration_s: float
    sessions: NonNegativeInt


class PolicyResult(BaseModel):
    model_config = _FROZEN

    name: str
    eviction: str
    role: Role
    requests: NonNegativeInt
    input_tokens: NonNegativeInt
    requested_blocks: NonNegativeInt
    requests_with_hit: NonNegativeInt
    admitted_requests: NonNegativeInt
    ram_hit_blocks: NonNegativeInt
    disk_hit_blocks: NonNegativeInt
    ram_saved_tokens: NonNegativeInt
    disk_saved_tokens: NonNegativeInt
    saved_tokens: NonNegativeInt
    # Hit blocks over requested blocks, and saved prefill tokens over input tokens.
    block_hit_rate: float
    token_hit_rate: float
    ram_blocks_written: NonNegativeInt
    disk_blocks_written: NonNegativeInt
    ram_bytes_written: NonNegativeInt
    disk_bytes_written: NonNegativeInt
    bytes_written: NonNegativeInt
    # None when nothing was written.
    saved_tokens_per_gb_written: float | None
    stats: dict[str, JsonValue]

    @property
    def reads_the_future(self) -> bool:
        """A bound (it knows what the trace does next), not a policy."""
        return self.stats.get("reads_the_future") is True

    @classmethod
    def from_tally(
        cls,
        name: str,
        eviction: str,
        role: Role,
        tally: Tally,
        block_bytes: int,
        stats: dict[str, JsonValue],
    ) -> PolicyResult:
        saved = tally.saved_tokens
        ram_bytes = tally.ram_blocks_written * block_bytes
        disk_bytes = tally.disk_blocks_written * block_bytes
        written = ram_bytes + disk_bytes
        return cls(
            name=name,
            eviction=eviction,
            role=role,
            requests=tally.requests,
            input_tokens=tally.input_tokens,
            requested_blocks=tally.requested_blocks,
            requests_with_hit=tally.requests_with_hit,
            admitted_requests=tally.admitted_requests,
            ram_hit_blocks=tally.ram_hit_blocks,
            disk_hit_blocks=tally.disk_hit_blocks,
            ram_saved_tokens=tally.ram_saved_tokens,
            disk_saved_tokens=tally.disk_saved_tokens,
            saved_tokens=saved,
            block_hit_rate=ratio(
                tally.ram_hit_blocks + tally.disk_hit_blocks, tally.requested_blocks
            )
            or 0.0,
            token_hit_rate=ratio(saved, tally.input_tokens) or 0.0,
            ram_blocks_written=tally.ram_blocks_written,
            disk_blocks_written=tally.disk_blocks_written,
            ram_bytes_written=ram_bytes,
            disk_bytes_written=disk_bytes,
            bytes_written=written,
            saved_tokens_per_gb_written=ratio(saved, written / GB),
            stats=stats,
        )


class Comparison(BaseModel):
    """A policy against the store-everything LRU baseline at the same budget."""

    model_config = _FROZEN

    policy: str
    # policy saved tokens / LRU saved tokens; None when LRU saved none.
    saved_ratio: float | None
    # LRU bytes written / policy bytes written; None when the policy wrote nothing.
    write_reduction: float | None
    # The share of the offline bound's gain over LRU this policy captured:
    # (saved - LRU saved) / (bound saved - LRU saved); None when the bound gains nothing.
    bound_share: float | None
    # Whether a target applies (the policy named TARGET_POLICY, at a budget TARGETS names), what
    # it asks, and whether it is met: saved and writes against LRU, and saved >= the best online.
    target_applies: bool
    target_saved_ratio: float | None
    target_write_reduction: float | None
    at_least_best_online: bool | None
    target_met: bool | None


class BudgetRun(BaseModel):
    model_config = _FROZEN

    budget_fraction: float
    ram_bytes: NonNegativeInt
    ram_blocks: NonNegativeInt
    disk_bytes: NonNegativeInt
    disk_blocks: NonNegativeInt
    # The most any policy could save, over what LRU saved at this budget (None when LRU saved none).
    ceiling_saved_ratio: float | None
    # The offline bound's saved tokens over LRU's (None when it was not run or LRU saved none).
    bound_saved_ratio: float | None
    # The baseline that saved the most (ties: the first run), and its saved tokens over LRU's.
    best_online: str
    best_online_saved_ratio: float | None
    policies: tuple[PolicyResult, ...]
    comparisons: tuple[Comparison, ...]

    def policy(self, name: str) -> PolicyResult:
        for result in self.policies:
            if result.name == name:
                return result
        raise KeyError(f"no policy named {name!r} at budget {self.budget_fraction}")


class SweepSettings(BaseModel):
    model_config = _FROZEN

    limit: int | None
    budget_fractions: tuple[float, ...]
    disk_fraction: float
    store_threshold: int
    kvci_ram_thresholds: tuple[float, ...]
    prefill_tokens_per_second: float
    session_key_blocks: int
    session_threads: bool = False
    max_sessions: int
    rewrite_window_s: float
    seed: int


class SimulationReport(BaseModel):
    model_config = _FROZEN

    report_format: str = SCHEMA
    # Names the trace's section and files (a second trace gets its own).
    label: str
    command: str
    trace: TraceSummary
    model: ModelShape
    bytes_per_token: int
    block_tokens: int
    block_bytes: int
    working_set_blocks: int
    working_set_bytes: int
    # Saved tokens of a cache that never evicts: no policy at any budget saves more.
    ceiling_saved_tokens: int
    # How often a request's session continues, by what is known when it finishes (reads the trace).
    follow_up: FollowUpTable
    settings: SweepSettings
    runs: tuple[BudgetRun, ...]
    runtime_s: float


def budget_run(
    budget_fraction: float,
    ram_blocks: int,
    disk_blocks: int,
    block_bytes: int,
    ceiling_saved_tokens: int,
    results: Sequence[PolicyResult],
) -> BudgetRun:
    """One budget's results with their comparisons; ``results`` hold ``BASELINE`` and a baseline."""
    by_name = {result.name: result for result in results}
    baseline = by_name[BASELINE]
    bound = by_name.get(OFFLINE_BOUND)
    best = max(
        (result for result in results if result.role == "baseline"),
        key=lambda result: result.saved_tokens,
    )
    return BudgetRun(
        budget_fraction=budget_fraction,
        ram_bytes=ram_blocks * block_bytes,
        ram_blocks=ram_blocks,
        disk_bytes=disk_blocks * block_bytes,
        disk_blocks=disk_blocks,
        ceiling_saved_ratio=ratio(ceiling_saved_tokens, baseline.saved_tokens),
        bound_saved_ratio=ratio(bound.saved_tokens, baseline.saved_tokens)
        if bound is not None
        else None,
        best_online=best.name,
        best_online_saved_ratio=ratio(best.saved_tokens, baseline.saved_tokens),
        policies=tuple(results),
        comparisons=tuple(
            compare(result, baseline, bound, best, budget_fraction)
            for result in results
            if result is not baseline
        ),
    )


def compare(
    result: PolicyResult,
    baseline: PolicyResult,
    bound: PolicyResult | None,
    best_online: PolicyResult,
    budget_fraction: float,
) -> Comparison:
    saved_ratio = ratio(result.saved_tokens, baseline.saved_tokens)
    write_reduction = ratio(baseline.bytes_written, result.bytes_written)
    bound_share = None
    if bound is not None and bound.saved_tokens > baseline.saved_tokens:
        bound_share = (result.saved_tokens - baseline.saved_tokens) / (
            bound.saved_tokens - baseline.saved_tokens
        )
    target = target_for(budget_fraction) if result.name == TARGET_POLICY else None
    at_least_best = met = None
    if target is not None:
        at_least_best = result.saved_tokens >= best_online.saved_tokens
        met = (
            at_least_best
            and saved_ratio is not None
            and saved_ratio >= target.saved_ratio
            # None: it wrote nothing, fewer bytes than any reduction asks.
            and (
                target.write_reduction is None
                or write_reduction is None
                or write_reduction >= target.write_reduction
            )
        )
    return Comparison(
        policy=result.name,
        saved_ratio=saved_ratio,
        write_reduction=write_reduction,
        bound_share=bound_share,
        target_applies=target is not None,
        target_saved_ratio=target.saved_ratio if target is not None else None,
        target_write_reduction=target.write_reduction if target is not None else None,
        at_least_best_online=at_least_best,
        target_met=met,
    )


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None
