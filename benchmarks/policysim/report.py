"""The JSON report of a sweep: every figure the table, the plot and the results README show."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from benchmarks.policysim.follow_up import FollowUpTable
from benchmarks.policysim.model_shape import ModelShape
from benchmarks.policysim.replay import Tally

SCHEMA = "kvci-policy-sim/2"
GB = 1_000_000_000
# The targets for kvci against store-everything LRU, at budgets up to 25 % of the working set.
TARGET_SAVED_RATIO = 1.2
TARGET_WRITE_REDUCTION = 3.0
TARGET_MAX_BUDGET_FRACTION = 0.25
BASELINE = "lru"

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
    saved_tokens_per_gb_written: Optional[float]
    stats: dict[str, JsonValue]

    @property
    def reads_the_future(self) -> bool:
        """A bound (it knows what the trace does next), not a policy."""
        return self.stats.get("reads_the_future") is True

    @classmethod
    def from_tally(
        cls, name: str, eviction: str, tally: Tally, block_bytes: int, stats: dict[str, JsonValue]
    ) -> PolicyResult:
        saved = tally.ram_saved_tokens + tally.disk_saved_tokens
        ram_bytes = tally.ram_blocks_written * block_bytes
        disk_bytes = tally.disk_blocks_written * block_bytes
        written = ram_bytes + disk_bytes
        return cls(
            name=name,
            eviction=eviction,
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
            block_hit_rate=ratio(tally.ram_hit_blocks + tally.disk_hit_blocks, tally.requested_blocks) or 0.0,
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
    saved_ratio: Optional[float]
    # LRU bytes written / policy bytes written; None when the policy wrote nothing.
    write_reduction: Optional[float]
    # Whether the targets apply (kvci policies, budgets <= 25 %), and whether they are met.
    target_applies: bool
    target_met: Optional[bool]


class BudgetRun(BaseModel):
    model_config = _FROZEN

    budget_fraction: float
    ram_bytes: NonNegativeInt
    ram_blocks: NonNegativeInt
    disk_bytes: NonNegativeInt
    disk_blocks: NonNegativeInt
    # The most any policy could save, over what LRU saved at this budget (None when LRU saved none).
    ceiling_saved_ratio: Optional[float]
    policies: tuple[PolicyResult, ...]
    comparisons: tuple[Comparison, ...]

    def policy(self, name: str) -> PolicyResult:
        for result in self.policies:
            if result.name == name:
                return result
        raise KeyError(f"no policy named {name!r} at budget {self.budget_fraction}")


class SweepSettings(BaseModel):
    model_config = _FROZEN

    limit: Optional[int]
    budget_fractions: tuple[float, ...]
    disk_fraction: float
    store_threshold: int
    kvci_ram_thresholds: tuple[float, ...]
    prefill_tokens_per_second: float
    session_key_blocks: int
    max_sessions: int
    rewrite_window_s: float
    seed: int


class SimulationReport(BaseModel):
    model_config = _FROZEN

    report_format: str = SCHEMA
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


def compare(result: PolicyResult, baseline: PolicyResult, budget_fraction: float) -> Comparison:
    saved_ratio = ratio(result.saved_tokens, baseline.saved_tokens)
    write_reduction = ratio(baseline.bytes_written, result.bytes_written)
    applies = result.name.startswith("kvci") and budget_fraction <= TARGET_MAX_BUDGET_FRACTION
    met: Optional[bool] = None
    if applies:
        met = (
            saved_ratio is not None
            and saved_ratio >= TARGET_SAVED_RATIO
            and (write_reduction is None or write_reduction >= TARGET_WRITE_REDUCTION)
        )
    return Comparison(
        policy=result.name,
        saved_ratio=saved_ratio,
        write_reduction=write_reduction,
        target_applies=applies,
        target_met=met,
    )


def ratio(numerator: float, denominator: float) -> Optional[float]:
    return numerator / denominator if denominator else None
