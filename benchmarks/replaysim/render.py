"""The results README's section of an engine replay report (``benchmarks/replay.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.replaysim.report import RUNS, SCHEMA, TARGET_AGREEMENT, ReplayReport

# kvci's counters the section shows, by series name.
COUNTERS = {
    "vllm:kvci_checkpoints": "kept",
    "vllm:kvci_evicted_checkpoints": "evicted",
    "vllm:kvci_ram_evicted_unread": "evicted before any hit",
    "vllm:kvci_ram_refused_under_pressure": "refused under pressure",
    "vllm:kvci_cache_gate_pauses": "cache gate paused",
}


def load_replays(results: Path) -> list[tuple[Path, ReplayReport]]:
    """The replay reports in ``results``, by file name."""
    found = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("report_format") == SCHEMA:
            found.append((path, ReplayReport.model_validate(data)))
    return found


def replay_section(path: Path, report: ReplayReport) -> list[str]:
    start_load, end_load = report.load_average
    a = report.agreement
    vllm_requests = report.engine_blocks / report.mean_request_blocks
    lines = [
        f"## {path.stem}",
        "",
        f"Command (from the repository root, {report.runtime_s:.0f} s): `{report.command}`",
        "",
        (
            f"- vLLM {report.vllm_version} on CPU: {report.cpus} CPUs, shared (1-minute load "
            f"average {start_load:.1f} at the start, {end_load:.1f} at the end). Engines ran one "
            "after another."
        ),
        (
            f"- The first {report.requests:,} requests of `{Path(report.trace).name}` (sha256 "
            f"`{report.trace_sha256[:12]}`, {report.trace_duration_s:.0f} s of trace time), paced "
            f"at trace time / {report.time_scale:g}, one request at a time; each 512-token trace "
            f"block is one {report.engine_block_tokens}-token engine block, outputs capped at "
            f"{report.max_output_tokens} tokens."
        ),
        (
            f"- Tiny model ({report.model['num_layers']} layers, hidden "
            f"{report.model['hidden_size']}, {report.model['dtype']}): {report.page_bytes:,} B per "
            f"block. vLLM's own KV cache: {report.engine_blocks:,} blocks (about "
            f"{vllm_requests:.1f} mean requests of {report.mean_request_blocks:.1f} blocks), "
            "prefix caching on."
        ),
        (
            f"- kvci RAM tier: {report.budget_fraction:.1%} of the slice's "
            f"{report.distinct_blocks:,} distinct blocks = {report.ram_blocks:,} blocks "
            f"({report.ram_bytes / (1 << 20):,.1f} MiB); the simulator's RAM tier holds the same "
            "number of blocks, on the timeline the engine saw"
            + (
                "."
                if report.simulated_engine_cache_blocks is None
                else ", behind a model of vLLM's prefix cache "
                f"({report.simulated_engine_cache_blocks:,} blocks: its pool but the null block), "
                "and its observations count engine tokens, as the connector's do."
            )
        ),
        "",
        "| run | saved by vLLM's cache | saved by kvci RAM | saved, share of prompt tokens | "
        "requests kvci kept | TTFT p50 | TTFT p90 |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for name, run in report.runs.items():
        kept = "-" if run.extra_config is None else f"{run.kept_requests:,}"
        lines.append(
            f"| {RUNS[name]} | {run.saved_vllm_tokens:,} | {run.saved_kvci_tokens:,} | "
            f"{run.saved_share:.1%} | {kept} | {run.ttft_p50_s * 1000:.1f} ms | "
            f"{run.ttft_p90_s * 1000:.1f} ms |"
        )
    lines += [
        "",
        (
            "Simulator (`benchmarks.policysim`, trace tokens), the same slice and budget"
            + (
                ":"
                if report.simulated_engine_cache_blocks is None
                else "; saved tokens are its vLLM cache's and its tier's together:"
            )
        ),
        "",
        "| policy | timeline of | saved tokens | share of input tokens | requests admitted | "
        "blocks written |",
        "|---|---|--:|--:|--:|--:|",
    ]
    product = [report.simulated_product_lru] if report.simulated_product_lru is not None else []
    for sim in [*report.simulated.values(), *product]:
        lines.append(
            f"| {sim.policy} | {sim.timeline} | {sim.saved_tokens:,} | {sim.saved_share:.1%} "
            f"| {sim.admitted_requests:,} | {sim.ram_blocks_written:,} |"
        )
    lines += [
        "",
        (f"Saved tokens, kvci / keeping everything: engine {_times(a.engine_ratio)}, simulator "
         f"{_times(a.simulator_ratio)} (kvci / lru): "
         + ("no ratio to compare." if a.relative_gap is None else f"{a.relative_gap:.1%} apart")
         + f" — {'within' if a.agrees else 'not within'} {TARGET_AGREEMENT:.0%}. "
         f"kvci's policy {'>=' if a.kvci_not_worse else '<'} keeping everything on the engine."),
    ]
    p = report.product_agreement
    if p is not None:
        lines.append(
            "Against the product's own keep-everything policy in the simulator (kvci-lru: the RAM "
            "index with ram_policy lru, checkpoint by checkpoint, as the engine runs it): "
            f"simulator {_times(p.simulator_ratio)}, "
            + ("no ratio to compare." if p.relative_gap is None else f"{p.relative_gap:.1%} apart")
            + f" — {'within' if p.agrees else 'not within'} {TARGET_AGREEMENT:.0%}."
        )
    lines += [
        "",
        "kvci's counters (vLLM metrics): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{label} {run.kvci_metrics.get(series, 0):,.0f}"
                                    for series, label in COUNTERS.items())
            for name, run in report.runs.items() if run.extra_config is not None)
        + ".",
    ]
    return lines


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"
