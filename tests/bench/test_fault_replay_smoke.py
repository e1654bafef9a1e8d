"""The fault replay (``benchmarks/fault_replay.py``): the slice, the phases, the report and its
README section without an engine, then one real ``--quick`` run (a PostgreSQL stop under a running
engine; no timed assertions, and none on kvci's containment: the run must report, whatever kvci
did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvci_plugin
from benchmarks.faultsim.logs import key_lines
from benchmarks.faultsim.render import fault_section, load_fault_replays
from benchmarks.faultsim.report import PHASES, EngineRun, FaultReplayReport, PhaseStats, Sample
from benchmarks.faultsim.windows import fault_run, phase_of
from benchmarks.faultsim.workload import select_threads
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest
from benchmarks.render_results import load_reports, render

REPO_ROOT = Path(kvci_plugin.__file__).resolve().parents[1]


def req(chain: list[int], at_ms: int = 0) -> TraceRequest:
    return TraceRequest(at_ms, len(chain) * BLOCK_TOKENS - 100, 50, tuple(chain))


# --- the slice -----------------------------------------------------------------------------------


def test_the_slice_is_the_multi_turn_threads_that_start_early_with_all_their_turns() -> None:
    trace = [
        req([0, 1, 2], 0),  # a: its first turn
        req([20, 5], 1),  # a one-turn thread: left out
        req([30, 7, 8], 2),  # c: first turn
        req([0, 1, 2, 3], 3),  # a: second turn
        req(
            [40, 9, *range(100, 140)], 4
        ),  # d: starts early, too long for the model: left out whole
        req([40, 9, *range(100, 141)], 5),  # d: its second turn
        req([30, 7, 8, 4], 6),  # c: second turn
        req([50, 11, 13], 7),  # e: starts too late
        req([50, 11, 13, 12], 8),  # e: second turn
    ]
    kept = select_threads(trace, sessions_from=5, max_blocks=40)
    assert [r.timestamp_ms for r in kept] == [0, 2, 3, 6]


# --- phases, recovery and the report -------------------------------------------------------------


def sample(
    index: int,
    sent: float | None,
    *,
    tier: str | None = None,
    kvci: int = 0,
    failed: bool = False,
    mismatch: bool | None = False,
    step: float = 0.01,
    ttft: float | None = 0.02,
) -> Sample:
    return Sample(
        index=index,
        due_s=float(index),
        sent_s=sent,
        ttft_s=None if failed else ttft,
        prompt_tokens=100,
        cached_tokens=kvci,
        kvci_tokens=kvci,
        hit_tier=tier if kvci else None,
        failed=failed,
        mismatch=None if failed else mismatch,
        worst_step_s=step,
        steps=0 if sent is None else 3,
        persist="persisting" if sent is not None else None,
    )


def engine_run(
    name: str, samples: list[Sample], steps: list[tuple[float, float]], **kw: object
) -> EngineRun:
    fields: dict[str, object] = dict(
        name=name,
        extra_config=None,
        engine_start_s=1.0,
        warm_requests=0,
        warm_s=0.0,
        measured_s=10.0,
        engine_died=False,
        hung=False,
        died_at_s=None,
        error=None,
        log_lines=[],
        kvci_metrics={},
        samples=samples,
        steps=steps,
    )
    fields.update(kw)
    return EngineRun.model_validate(fields)


def test_phases_follow_the_fault_runs_send_times_and_the_anchor_takes_the_same_requests() -> None:
    assert phase_of(0.9, 1.0, 3.0) == "before"
    assert phase_of(1.0, 1.0, 3.0) == phase_of(2.9, 1.0, 3.0) == "during"
    assert phase_of(3.0, 1.0, 3.0) == "after"
    assert phase_of(5.0, None, None) == "before"
    t0 = 100.0
    window = SimpleNamespace(injected=t0 + 2.0, restored=t0 + 4.0, answered=t0 + 4.5, error=None,
                             terminated_backends=0)
    # Sent late (the engine stalled during the fault): request 3 was due during it and is "after".
    kvci = engine_run(
        "pg_stop",
        [
            sample(0, 0.0, tier="disk", kvci=64),
            sample(1, 1.0, tier="disk", kvci=32),
            sample(2, 2.5, step=1.5),
            sample(3, 4.6),
            sample(4, 5.0),
            sample(5, 7.0, tier="disk", kvci=96),
            sample(6, None, failed=True),
        ],
        # A request sent just before the fault whose step waits on the dependency is the fault's.
        [(0.0, 0.01), (1.0, 0.01), (1.9, 1.5), (3.5, 0.1), (4.6, 0.3), (7.0, 0.01)],
    )
    anchor = engine_run("anchor", [sample(i, float(i), step=0.02, ttft=0.04) for i in range(7)],
                        [(float(i), 0.02) for i in range(7)])
    floor = engine_run("floor", [sample(i, float(i), mismatch=None, ttft=0.08) for i in range(7)],
                       [(float(i), 0.03) for i in range(7)])
    fault = fault_run("pg_stop", window, kvci, anchor, floor, t0)  # type: ignore[arg-type]
    assert [s.phase for s in fault.run.samples] == [
        "before",
        "before",
        "during",
        "after",
        "after",
        "after",
        "after",
    ]
    assert (fault.injected_at_s, fault.restored_at_s, fault.answered_at_s) == (2.0, 4.0, 4.5)
    during, after = fault.phases["during"], fault.phases["after"]
    assert during.kvci.worst_step_s == 1.5 and during.anchor.worst_step_s == 0.02
    assert during.worst_step_vs_anchor == pytest.approx(75.0)
    assert (
        fault.phases["before"].kvci.steps,
        during.kvci.steps,
        fault.phases["after"].kvci.steps,
    ) == (2, 2, 2)
    assert (
        fault.phases["after"].kvci.worst_step_s == 0.3 and during.anchor.steps == 3
    )  # at 2, 3 and 4 s
    assert during.ttft_p50_vs_anchor == pytest.approx(
        0.5
    ) and during.ttft_p50_vs_floor == pytest.approx(0.25)
    assert after.kvci.requests == after.anchor.requests == after.floor.requests == 4
    assert (
        after.kvci.failed == 1 and after.kvci.saved_disk_tokens == 96 and after.kvci.disk_hits == 1
    )
    # Answered at 4.5 s; the first disk hit was sent at 7.0 s, after two requests served otherwise.
    assert fault.recovery.first_disk_hit_s == pytest.approx(2.5)
    assert fault.recovery.requests_before_first_disk_hit == 2
    assert fault.recovery.disk_hits_during == 0
    stats = PhaseStats.of(kvci.samples[:2], [])
    assert (stats.saved_tokens, stats.saved_disk_tokens, stats.saved_vllm_tokens) == (96, 96, 0)
    assert stats.persist == {"persisting": 2}

    report = FaultReplayReport(
        command="python -m benchmarks.fault_replay",
        runtime_s=1.0,
        vllm_version="0",
        cpus=2,
        load_average=(0.0, 0.0),
        trace="trace.jsonl",
        trace_sha256="0" * 64,
        workload={
            "sessions_from": 1,
            "scan": 1,
            "requests": 7,
            "threads": 2,
            "warm_requests": 0,
            "measured_requests": 7,
            "prompt_tokens_mean": 100.0,
            "distinct_blocks": 10,
            "engine_block_tokens": 32,
            "max_output_tokens": 4,
        },
        model={"num_layers": 2, "hidden_size": 128, "num_kv_heads": 2, "dtype": "float32"},
        settings={
            "interval_s": 1.0,
            "fault_s": 2.0,
            "inject_due_s": 2.0,
            "terminate_every_s": 1.0,
            "hang_s": 60.0,
            "ram_fraction": 0.05,
            "ram_blocks": 1,
            "ram_bytes": 1 << 20,
            "page_bytes": 1 << 20,
            "engine_blocks": 10,
            "max_model_len": 288,
            "timeouts": None,
        },
        containment_in_tree={"tiering.health": True},
        floor=floor,
        anchor=anchor,
        faults={"pg_stop": fault},
    )
    again = FaultReplayReport.model_validate_json(report.model_dump_json())
    assert again == report
    section = "\n".join(fault_section(Path("fault_replay.json"), again))
    assert "| `pg_stop` | no | 1 of 7 |" in section
    assert all(f"| {label} |" in section for label in PHASES.values())


def test_key_log_lines_are_kvcis_and_the_errors_counted_once() -> None:
    lines = [
        "(EngineCore pid=12) WARNING 12-06 04:36:25 [health.py:137] kvci: disk tier unavailable",
        "(EngineCore pid=12) WARNING 12-06 04:36:29 [health.py:137] kvci: disk tier unavailable",
        "(MainProcess pid=3) WARNING 12-06 04:35:17 [utils.py:648] [shutdown] force killing",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "psycopg.OperationalError: the connection is lost",
        "[fault_replay] fault pg_stop: injected",
    ]
    got = key_lines(lines)
    assert [(line.count, line.line.split("]")[-1].strip()) for line in got][:1] == [
        (2, "kvci: disk tier unavailable")
    ]
    assert len(got) == 4 and got[-1].line == "psycopg.OperationalError: the connection is lost"


# --- one real run --------------------------------------------------------------------------------


def threads_trace(path: Path, threads: int = 30, turns: int = 4) -> Path:
    """A Mooncake-format trace of multi-turn threads (each turn re-sends the one before and adds
    a block), interleaved: the test runs without the shared traces a fresh clone lacks."""
    rows = []
    for turn in range(turns):
        for t in range(threads):
            chain = [1000 * t + b for b in range(3 + turn)]
            rows.append({"timestamp": 100 * len(rows), "input_length": len(chain) * 512 - 100,
                         "output_length": 50, "hash_ids": chain})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.engine
def test_a_quick_fault_replay_reports_every_phase_and_the_readme_shows_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    trace = threads_trace(tmp_path / "trace.jsonl")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fault_replay", "--quick", "--trace", str(trace),
         "--json", str(results / "fault_replay.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = FaultReplayReport.model_validate_json(
        (results / "fault_replay.json").read_text(encoding="utf-8")
    )

    assert list(report.faults) == ["pg_stop"]
    measured = report.workload["measured_requests"]
    for run in (report.floor, report.anchor):
        assert not run.engine_died and run.failed == 0 and len(run.samples) == measured
    fault = report.faults["pg_stop"]
    assert (
        fault.fault_error is None
        and fault.injected_at_s is not None
        and fault.answered_at_s is not None
    )
    assert fault.injected_at_s < fault.answered_at_s
    assert len(fault.run.samples) == measured
    assert sum(v.kvci.requests for v in fault.phases.values()) == measured
    assert all(v.kvci.requests > 0 for v in fault.phases.values())
    # Before the fault the warm-up's sessions come back from the disk tier.
    assert fault.phases["before"].kvci.saved_disk_tokens > 0 or fault.run.engine_died
    assert (
        json.loads((results / "fault_replay.json").read_text())["report_format"]
        == "kvci-fault-replay/1"
    )

    assert load_fault_replays(results) == [(results / "fault_replay.json", report)]
    readme = render(*load_reports(results), (), load_fault_replays(results))
    assert (
        "## fault_replay" in readme
        and "### PostgreSQL stopped, then restarted (`pg_stop`)" in readme
    )
