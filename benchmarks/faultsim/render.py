"""The results README's section of a fault replay report (``benchmarks/fault_replay.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.faultsim.report import PHASES, SCHEMA, FaultReplayReport, FaultRun, PhaseStats

# Log lines shown per fault (the report keeps more).
SHOWN_LOG_LINES = 8


def load_fault_replays(results: Path) -> list[tuple[Path, FaultReplayReport]]:
    """The fault replay reports in ``results``, by file name."""
    found = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("report_format") == SCHEMA:
            found.append((path, FaultReplayReport.model_validate(data)))
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f}"


def _pair(stats: PhaseStats) -> str:
    return f"{_ms(stats.ttft_p50_s)} / {_ms(stats.ttft_p90_s)}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def fault_section(path: Path, report: FaultReplayReport) -> list[str]:
    w, st, model = report.workload, report.settings, report.model
    start_load, end_load = report.load_average
    tree = ", ".join(
        f"{name} {'yes' if present else 'no'}"
        for name, present in report.containment_in_tree.items()
    )
    timeouts = "kvci's defaults" if st["timeouts"] is None else f"`{json.dumps(st['timeouts'])}`"
    lines = [
        f"## {path.stem}",
        "",
        f"Command (from the repository root, {report.runtime_s:.0f} s): `{report.command}`",
        "",
        (
            f"- vLLM {report.vllm_version} on CPU: {report.cpus} CPUs, shared (1-minute load "
            f"average {start_load:.1f} at the start, {end_load:.1f} at the end). Engines ran one "
            "after another: the floor (no connector, no prefix cache: every prompt recomputed), "
            "the anchor (kvci with its RAM tier only), then one kvci engine per fault with its "
            "disk tier on PostgreSQL (catalog) and Redis (blobs) that the benchmark started, each "
            "run on a fresh database of both."
        ),
        (
            f"- Workload: the multi-turn threads of `{Path(report.trace).name}` (sha256 "
            f"`{report.trace_sha256[:12]}`) that start within its first {w['sessions_from']:,} "
            f"requests, with their turns within its first {w['scan']:,}, in trace order: "
            f"{w['requests']:,} requests of {w['threads']:,} threads; the first "
            f"{w['warm_requests']:,} a warm-up (not measured), then {w['measured_requests']:,} "
            f"measured, one every {st['interval_s'] * 1e3:,.0f} ms, one at a time (mean prompt "
            f"{w['prompt_tokens_mean']:,.0f} tokens). Each 512-token trace block is one "
            f"{w['engine_block_tokens']}-token engine block (as `benchmarks/replay.py` maps it); "
            f"{w['max_output_tokens']} greedy tokens per request; every request asks kvci to "
            "persist (a valid session credential)."
        ),
        (
            f"- Tiny model ({model['num_layers']} layers, hidden {model['hidden_size']}, "
            f"{model['dtype']}). kvci's RAM tier {st['ram_blocks']:,} blocks "
            f"({st['ram_bytes'] / (1 << 20):,.1f} MiB, {st['ram_fraction']:.0%} of the slice's "
            f"{w['distinct_blocks']:,} distinct blocks); vLLM's KV cache {st['engine_blocks']:,} "
            "blocks (the longest request and one more), prefix caching on but on the floor. "
            f"kvci's timeouts: {timeouts}. Containment in this tree: {tree}."
        ),
        (
            f"- Each fault held {st['fault_s']:g} s from {st['inject_due_s']:.1f} s into the "
            f"measured slice (`pg_terminate`: every {st['terminate_every_s']:g} s through it); a "
            "request's phase is when the fault run sent it: before the dependency went down, "
            "until it answered again, after. The anchor's and the floor's columns are the same "
            "requests on their engines. Worst step: the longest `llm_engine.step()` call of the "
            "phase's time window, a call that overlaps the fault window (down to answering again) "
            "counting as the fault's; the same window of the anchor's run. TTFT: `add_request` to "
            f"the step that returned the first token. A step longer than {st['hang_s']:g} s counts "
            "as a hang (the engine is killed)."
        ),
        "",
        "### Summary",
        "",
        (
            "| fault | engine died | failed requests | outputs unlike the floor's | worst step "
            "during the fault (ms) | anchor's, same requests (ms) | vs anchor | dependency "
            "answered -> first disk hit (s) | requests in between | disk hits during the fault | "
            "kvci replies with an error |"
        ),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, fault in report.faults.items():
        run, during = fault.run, fault.phases["during"]
        died = "no" if not run.engine_died else ("yes (hung)" if run.hung else "yes")
        mismatches = sum(v.kvci.mismatches for v in fault.phases.values())
        compared = sum(v.kvci.compared for v in fault.phases.values())
        errors = sum(v.kvci.kvci_errors for v in fault.phases.values())
        r = fault.recovery
        between = (
            "-"
            if r.requests_before_first_disk_hit is None
            else f"{r.requests_before_first_disk_hit:,}"
        )
        lines.append(
            f"| `{name}` | {died} | {run.failed:,} of {len(run.samples):,} | {mismatches:,} of "
            f"{compared:,} | {_ms(during.kvci.worst_step_s)} | {_ms(during.anchor.worst_step_s)} | "
            f"{_times(during.worst_step_vs_anchor)} | {_s(r.first_disk_hit_s)} | {between} | "
            f"{r.disk_hits_during:,} | {errors:,} |"
        )
    lines += [
        "",
        (
            f"Floor and anchor: {report.floor.failed:,} and {report.anchor.failed:,} failed "
            "requests; the anchor's outputs unlike the floor's: "
            f"{sum(bool(s.mismatch) for s in report.anchor.samples):,} of "
            f"{sum(s.mismatch is not None for s in report.anchor.samples):,}."
        ),
    ]
    for name, fault in report.faults.items():
        lines += ["", *_fault_lines(name, fault)]
    return lines


def _fault_lines(name: str, fault: FaultRun) -> list[str]:
    run = fault.run
    when = (
        f"Down at {_s(fault.injected_at_s)} s, restored at {_s(fault.restored_at_s)} s, answering "
        f"again at {_s(fault.answered_at_s)} s (since the measured slice began)"
    )
    if fault.terminated_backends:
        when += f"; {fault.terminated_backends:,} backends terminated"
    lines = [
        f"### {fault.description} (`{name}`)",
        "",
        when + (f". Applying the fault failed: {fault.fault_error}." if fault.fault_error else "."),
    ]
    if run.engine_died:
        lines.append(
            f"The engine died{' (hung: killed by the benchmark)' if run.hung else ''}"
            + (
                f" {run.died_at_s:.1f} s into the measured slice"
                if run.died_at_s is not None
                else ""
            )
            + f": `{(run.error or '').splitlines()[0][:300]}`."
        )
    lines += [
        "",
        (
            "| phase | requests | failed | unlike the floor | TTFT p50 / p90 (ms) | anchor p50 / "
            "p90 (ms) | p50 vs anchor | p90 vs anchor | floor p50 / p90 (ms) | saved tokens: kvci "
            "disk / kvci RAM / vLLM | anchor saved | worst step (ms) | anchor worst step (ms) |"
        ),
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for phase, label in PHASES.items():
        v = fault.phases[phase]
        k = v.kvci
        lines.append(
            f"| {label} | {k.requests:,} | {k.failed:,} | {k.mismatches:,} of {k.compared:,} | "
            f"{_pair(k)} | {_pair(v.anchor)} | {_times(v.ttft_p50_vs_anchor)} | "
            f"{_times(v.ttft_p90_vs_anchor)} | {_pair(v.floor)} | {k.saved_disk_tokens:,} / "
            f"{k.saved_ram_tokens:,} / {k.saved_vllm_tokens:,} | {v.anchor.saved_tokens:,} | "
            f"{_ms(k.worst_step_s)} | {_ms(v.anchor.worst_step_s)} |"
        )
    if run.log_lines:
        shown = run.log_lines[:SHOWN_LOG_LINES]
        lines += [
            "",
            f"kvci's and the engine's key log lines ({len(shown)} of {len(run.log_lines)} "
            "distinct, first seen first; repeats counted):",
            "",
            "```",
        ]
        lines += [f"{line.count:>4}x {line.line[:240]}" for line in shown]
        lines.append("```")
    return lines
