"""One sweep: every policy side by side at every budget, on one trace, in one process."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.policysim.admission import AdmissionPolicy, StoreEverything
from benchmarks.policysim.arc_cache import ARCBlockCache
from benchmarks.policysim.belady_bound import BeladyBound
from benchmarks.policysim.block_cache import BlockCache
from benchmarks.policysim.engine_view import EngineView
from benchmarks.policysim.follow_up import follow_up_table
from benchmarks.policysim.hindsight import NAME as HINDSIGHT
from benchmarks.policysim.hindsight import hindsight_policy
from benchmarks.policysim.kvci_tier import KVCITier, replay_kvci
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.model_shape import model_shape
from benchmarks.policysim.offer_threshold import StoreAfterNOffers
from benchmarks.policysim.oracle_admission import ContinuationOracle, continued_later
from benchmarks.policysim.random_admission import RandomAdmission
from benchmarks.policysim.replay import replay
from benchmarks.policysim.report import (
    BASELINE,
    BudgetRun,
    PolicyResult,
    Role,
    SimulationReport,
    SweepSettings,
    TraceSummary,
    budget_run,
)
from benchmarks.policysim.restart import LRU_NAME as LRU_RESTARTED
from benchmarks.policysim.restart import NAME as RESTARTED
from benchmarks.policysim.restart import WARM_NAME as RESTARTED_WARM
from benchmarks.policysim.restart import replay_lru_restarted, replay_restarted
from benchmarks.policysim.s3fifo_cache import S3FIFOBlockCache
from benchmarks.policysim.sessions import (
    DEFAULT_KEY_BLOCKS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_REWRITE_WINDOW_S,
    RequestContext,
    SessionTracker,
    session_contexts,
)
from benchmarks.policysim.tinylfu_cache import WTinyLFUBlockCache
from benchmarks.policysim.told import NAME as TOLD
from benchmarks.policysim.told import RANDOM_NAME as TOLD_RANDOM
from benchmarks.policysim.told import told_at_random, told_when_back
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest, load_trace
from benchmarks.policysim.worthiness_admission import WorthinessAdmission
from kvci_plugin.policy import ValuePolicy
from kvci_plugin.policy.admission import PressureAwareAdmission
from kvci_plugin.worthiness import DEFAULT_RAM_THRESHOLD, CheckpointAdvisor, RebuildCostModel

UnitFraction = Annotated[float, Field(gt=0.0, le=1.0)]

DEFAULT_BUDGET_FRACTIONS = (0.01, 0.025, 0.05, 0.10, 0.25)
DEFAULT_MODEL = "llama-3-8b-bf16"
# The rebuild-cost estimator's own rate, so the estimated prefill time and the scorer agree.
DEFAULT_PREFILL_TOKENS_PER_SECOND = RebuildCostModel().prefill_tokens_per_second


class SweepConfig(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    trace: Path
    # Names the report's section and files; None: derived from the trace's file name.
    label: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] | None = None
    limit: Annotated[int, Field(ge=1)] | None = None
    model: str = DEFAULT_MODEL
    budget_fractions: tuple[UnitFraction, ...] = DEFAULT_BUDGET_FRACTIONS
    # Disk budget as a fraction of the working set; 0 = no disk tier.
    disk_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    store_threshold: Annotated[int, Field(ge=2)] = 2
    # One kvci policy per threshold; the first is the one the random control is matched to.
    kvci_ram_thresholds: tuple[Annotated[float, Field(gt=0.0, le=1.0)], ...] = (
        DEFAULT_RAM_THRESHOLD,
    )
    prefill_tokens_per_second: Annotated[float, Field(gt=0.0)] = DEFAULT_PREFILL_TOKENS_PER_SECOND
    session_key_blocks: Annotated[int, Field(ge=1)] = DEFAULT_KEY_BLOCKS
    # Sessions as threads (a request continues the one it extends), as a client that sends a
    # session id per conversation makes them; False: keyed by their first blocks.
    session_threads: bool = True
    max_sessions: Annotated[int, Field(ge=1)] = DEFAULT_MAX_SESSIONS
    rewrite_window_s: Annotated[float, Field(gt=0.0)] = DEFAULT_REWRITE_WINDOW_S
    seed: int = 0
    # An engine replay's prediction (``benchmarks/replay.py``): vLLM's own cache in front, engine
    # tokens.
    engine: EngineView | None = None


def run_sweep(config: SweepConfig, *, command: str) -> SimulationReport:
    started = time.perf_counter()
    if not config.budget_fractions:
        raise ValueError("budget_fractions must name at least one budget")
    if not config.kvci_ram_thresholds:
        raise ValueError("kvci_ram_thresholds must name at least one threshold")
    if len(set(config.kvci_ram_thresholds)) != len(config.kvci_ram_thresholds):
        raise ValueError(f"kvci_ram_thresholds must be distinct, got {config.kvci_ram_thresholds}")
    shape = model_shape(config.model)
    requests = load_trace(config.trace, config.limit)
    tracker = SessionTracker(
        threads=config.session_threads,
        key_blocks=config.session_key_blocks,
        max_sessions=config.max_sessions,
        rewrite_window_s=config.rewrite_window_s,
    )
    contexts = session_contexts(requests, tracker)
    block_bytes = BLOCK_TOKENS * shape.bytes_per_token
    distinct_blocks = len({block for request in requests for block in request.hash_ids})
    never_evicts = replay(
        requests, contexts, StoreEverything(BASELINE), LRUBlockCache(distinct_blocks)
    )
    ceiling = never_evicts.ram_saved_tokens
    continued = continued_later(requests, config.session_key_blocks)
    runs = [
        _budget_run(
            config, requests, contexts, continued, fraction, distinct_blocks, block_bytes, ceiling
        )
        for fraction in sorted(config.budget_fractions)
    ]
    return SimulationReport(
        label=config.label or trace_label(config.trace),
        command=command,
        trace=_summary(config, requests, contexts, distinct_blocks),
        model=shape,
        bytes_per_token=shape.bytes_per_token,
        block_tokens=BLOCK_TOKENS,
        block_bytes=block_bytes,
        working_set_blocks=distinct_blocks,
        working_set_bytes=distinct_blocks * block_bytes,
        ceiling_saved_tokens=ceiling,
        follow_up=follow_up_table(requests, contexts, continued),
        settings=SweepSettings(
            limit=config.limit,
            budget_fractions=tuple(sorted(config.budget_fractions)),
            disk_fraction=config.disk_fraction,
            store_threshold=config.store_threshold,
            kvci_ram_thresholds=config.kvci_ram_thresholds,
            prefill_tokens_per_second=config.prefill_tokens_per_second,
            session_key_blocks=config.session_key_blocks,
            session_threads=config.session_threads,
            max_sessions=config.max_sessions,
            rewrite_window_s=config.rewrite_window_s,
            seed=config.seed,
        ),
        runs=tuple(runs),
        runtime_s=round(time.perf_counter() - started, 2),
    )


def _budget_run(
    config: SweepConfig,
    requests: list[TraceRequest],
    contexts: list[RequestContext],
    continued: list[bool],
    fraction: float,
    distinct_blocks: int,
    block_bytes: int,
    ceiling: int,
) -> BudgetRun:
    ram_blocks = _blocks(fraction, distinct_blocks, "budget")
    disk_blocks = (
        _blocks(config.disk_fraction, distinct_blocks, "disk_fraction")
        if config.disk_fraction
        else 0
    )

    def run(
        policy: AdmissionPolicy, cache: Callable[[int], BlockCache], eviction: str, role: Role
    ) -> PolicyResult:
        disk = LRUBlockCache(disk_blocks) if disk_blocks else None
        tally = replay(requests, contexts, policy, cache(ram_blocks), disk, config.engine)
        return PolicyResult.from_tally(
            policy.name, eviction, role, tally, block_bytes, policy.stats()
        )

    def told_run(name: str, told: list[bool | None], role: Role) -> PolicyResult:
        """The default kvci tier, its clients saying ``told`` (``benchmarks.policysim.told``)."""
        tier = KVCITier(
            ram_blocks,
            prefill_tokens_per_second=config.prefill_tokens_per_second,
            name=name,
            engine=config.engine,
            told=told,
        )
        tally = replay_kvci(requests, contexts, tier)
        stats = {**tier.stats(), "told_pending": sum(word is True for word in told)}
        if role == "bound":
            stats["reads_the_future"] = True
        return PolicyResult.from_tally(name, "kvci", role, tally, block_bytes, stats)

    results = [
        run(StoreEverything(BASELINE), LRUBlockCache, "lru", "baseline"),
        run(StoreEverything("arc"), ARCBlockCache, "arc", "baseline"),
        run(StoreEverything("s3-fifo"), S3FIFOBlockCache, "s3-fifo", "baseline"),
        run(StoreEverything("w-tinylfu"), WTinyLFUBlockCache, "w-tinylfu", "baseline"),
        run(StoreAfterNOffers(config.store_threshold), LRUBlockCache, "lru", "baseline"),
    ]
    kvci = [  # the worthiness bar, as ram_policy "threshold" runs it
        run(
            WorthinessAdmission(
                CheckpointAdvisor(ram_threshold=threshold),
                prefill_tokens_per_second=config.prefill_tokens_per_second,
            ),
            LRUBlockCache,
            "lru",
            "kvci",
        )
        for threshold in config.kvci_ram_thresholds
    ]
    # The connector's default: the RAM index with its ValuePolicy, as a user who sets nothing runs
    # it.
    tier = KVCITier(
        ram_blocks, prefill_tokens_per_second=config.prefill_tokens_per_second, engine=config.engine
    )
    default = PolicyResult.from_tally(
        tier.name,
        tier.policy.name,
        "kvci",
        replay_kvci(requests, contexts, tier),
        block_bytes,
        tier.stats(),
    )
    results.append(default)
    for name, warm in ((RESTARTED, False), (RESTARTED_WARM, True)):
        tally, stats = replay_restarted(
            requests,
            contexts,
            lambda policy, name=name: KVCITier(
                ram_blocks,
                prefill_tokens_per_second=config.prefill_tokens_per_second,
                policy=policy,
                name=name,
                engine=config.engine,
            ),
            warm=warm,
        )
        results.append(PolicyResult.from_tally(name, "kvci", "kvci", tally, block_bytes, stats))
    tally, stats = replay_lru_restarted(
        requests,
        contexts,
        ram_blocks,
        LRUBlockCache(disk_blocks) if disk_blocks else None,
        config.engine,
    )
    results.append(
        PolicyResult.from_tally(LRU_RESTARTED, "lru", "control", tally, block_bytes, stats)
    )
    results.extend(kvci)
    # The same advisor with the bar that follows the RAM tier's pressure (it learns from evictions).
    advisor = CheckpointAdvisor(ram_threshold=config.kvci_ram_thresholds[0])
    pressure = WorthinessAdmission(
        advisor,
        prefill_tokens_per_second=config.prefill_tokens_per_second,
        pressure=PressureAwareAdmission.for_advisor(
            advisor, capacity_bytes=ram_blocks * block_bytes
        ),
        block_bytes=block_bytes,
    )
    results.append(
        run(
            pressure,
            lambda capacity: LRUBlockCache(capacity, on_evict=pressure.evicted),
            "lru",
            "kvci",
        )
    )
    # The control: whole requests admitted blindly, as often as the default kvci policy admitted.
    rate = default.admitted_requests / default.requests
    results.append(run(RandomAdmission(rate, seed=config.seed), LRUBlockCache, "lru", "control"))
    results.append(told_run(TOLD_RANDOM, told_at_random(continued, seed=config.seed), "control"))
    results.extend(
        run(ContinuationOracle(continued, first_turns=first_turns), LRUBlockCache, "lru", "bound")
        for first_turns in (None, True, False)
    )
    assert isinstance(tier.policy, ValuePolicy)
    hindsight = KVCITier(ram_blocks, prefill_tokens_per_second=config.prefill_tokens_per_second,
                         policy=hindsight_policy(tier.policy, requests[-1].timestamp_ms / 1000.0),
                         name=HINDSIGHT, engine=config.engine)
    results.append(
        PolicyResult.from_tally(
            HINDSIGHT,
            "kvci",
            "bound",
            replay_kvci(requests, contexts, hindsight),
            block_bytes,
            {**hindsight.stats(), "reads_the_future": True},
        )
    )
    results.append(told_run(TOLD, told_when_back(continued), "bound"))
    bound = BeladyBound(requests, ram_blocks)
    results.append(run(bound, lambda capacity: bound, "belady", "bound"))
    return budget_run(fraction, ram_blocks, disk_blocks, block_bytes, ceiling, results)


def _blocks(fraction: float, distinct_blocks: int, field: str) -> int:
    blocks = int(fraction * distinct_blocks)
    if blocks < 1:
        raise ValueError(
            f"{field} {fraction} of a {distinct_blocks}-block working set holds no block"
        )
    return blocks


def trace_label(trace: Path) -> str:
    """``mooncake_conversation_trace.jsonl`` -> ``conversation``: the file name without the
    release's common prefix and suffix."""
    label = trace.name.split(".")[0]
    label = label.removeprefix("mooncake_").removesuffix("_trace")
    return label or "trace"


def _summary(
    config: SweepConfig,
    requests: list[TraceRequest],
    contexts: list[RequestContext],
    distinct_blocks: int,
) -> TraceSummary:
    return TraceSummary(
        path=str(config.trace),
        sha256=hashlib.sha256(config.trace.read_bytes()).hexdigest(),
        requests=len(requests),
        distinct_blocks=distinct_blocks,
        input_tokens=sum(request.input_length for request in requests),
        output_tokens=sum(request.output_length for request in requests),
        duration_s=(requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0,
        sessions=len(
            {context.session_id for context in contexts if context.session_id is not None}
        ),
    )
