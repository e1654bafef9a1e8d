"""The side-by-side report of ``benchmarks/bench_serve.py`` and its section of the results README.

A run's summary is read from the file ``vllm bench serve --save-result --save-detailed`` wrote:
its own figures (TTFT percentiles, throughput) as it computed them, and its per-request TTFTs,
which this module classes by turn (``benchmarks.benchserve.trace.TURN_CLASSES``). vLLM's client
keeps its outputs in the order of its dataset; the prompt lengths it reports are checked against
the slice's, request by request, before any TTFT is attributed to a turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.benchserve.trace import TURN_CLASSES, TimedRow
from benchmarks.report_files import reports_of

SCHEMA = "kvci-bench-serve/1"
# Fields of vllm bench serve's result file kept as they are.
SUMMARY_FIELDS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                  "request_throughput", "output_throughput", "total_token_throughput",
                  "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
                  "p90_tpot_ms", "p50_e2el_ms", "p90_e2el_ms")


def _percentiles(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50_ms": None, "p90_ms": None}
    p50, p90 = np.percentile(np.asarray(values, dtype=float), [50, 90])
    return {"n": len(values), "p50_ms": float(p50), "p90_ms": float(p90)}


def run_summary(raw: dict[str, Any], rows: Sequence[TimedRow], counters: dict[str, float],
                client_wall_s: float) -> dict[str, Any]:
    """One run's part of the report, from vllm bench serve's result file ``raw``."""
    input_lens = raw.get("input_lens")
    ttfts = raw.get("ttfts")
    if input_lens is None or ttfts is None:
        raise ValueError("the result file holds no per-request figures (--save-detailed)")
    expected = [row.input_length for row in rows]
    if list(input_lens) != expected:
        raise ValueError("vllm bench serve's prompts are not the slice's, in its order: "
                         f"lengths {list(input_lens)[:8]}... vs {expected[:8]}...")
    errors = raw.get("errors") or [""] * len(rows)
    by_class: dict[str, list[float]] = {name: [] for name in TURN_CLASSES}
    ttfts_ms: list[float | None] = []
    for row, ttft, error in zip(rows, ttfts, errors):
        ok = not error and ttft is not None and ttft > 0
        ttfts_ms.append(round(ttft * 1000.0, 3) if ok else None)
        if ok:
            by_class[row.turn_class].append(ttft * 1000.0)
    return {"summary": {key: raw.get(key) for key in SUMMARY_FIELDS},
            "ttft_by_turn": {name: _percentiles(values) for name, values in by_class.items()},
            "counters": counters, "client_wall_s": round(client_wall_s, 1),
            "ttfts_ms": ttfts_ms}


def comparison(report: dict[str, Any]) -> dict[str, float | None]:
    """vLLM alone over kvci (TTFT: higher is kvci faster) and kvci over vLLM (throughput)."""
    plain, kvci = report["runs"]["vllm"], report["runs"]["kvci"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    out = {f"ttft_{p}_vllm_over_kvci": ratio(plain["summary"][f"{p}_ttft_ms"],
                                              kvci["summary"][f"{p}_ttft_ms"])
           for p in ("p50", "p90")}
    for p in ("p50", "p90"):
        out[f"tool_return_ttft_{p}_vllm_over_kvci"] = ratio(
            plain["ttft_by_turn"]["tool_return"][f"{p}_ms"],
            kvci["ttft_by_turn"]["tool_return"][f"{p}_ms"])
    for field in ("request_throughput", "output_throughput"):
        out[f"{field}_kvci_over_vllm"] = ratio(kvci["summary"][field], plain["summary"][field])
    return out


def load_bench_serves(results: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The bench_serve reports in ``results``, by file name."""
    return reports_of(results, SCHEMA)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _source(report: dict[str, Any]) -> str:
    source = report.get("kvci_source") or {}
    if not source.get("commit"):
        return ""
    changed = source.get("changed_files", 0)
    return f", kvci from commit `{source['commit']}`" + (
        f" with {changed} files of `kvci_plugin`/`csrc` changed in the working tree" if changed
        else "")


def bench_serve_section(path: Path, report: dict[str, Any]) -> list[str]:
    """The results README's section of one bench_serve report."""
    trace, model = report["trace"], report["model"]
    env = ", ".join(f"{k}={v}" for k, v in report["env"].items()) or "no vLLM CPU settings"
    extra = report["kv_transfer_config"].get("kv_connector_extra_config", {})
    shown = {k: v for k, v in extra.items() if k != "state_dir"}
    engine = report["servers"]["vllm"]["argv"] or []
    blocks = (engine[engine.index("--num-gpu-blocks-override") + 1]
              if "--num-gpu-blocks-override" in engine else None)
    load = report["load_average"]
    lines = [
        f"## {path.stem}", "",
        f"Command (from the repository root, {report['runtime_s']:.0f} s): "
        f"`{report['command'].strip()}`",
        "",
        "`vllm bench serve` (vLLM's own client, its `timed_trace` dataset, open loop at the "
        "trace's times) against vLLM alone and vLLM with kvci, one server after the other, "
        "the same arguments but kvci's `--kv-transfer-config`. Requests say nothing to kvci "
        "(no `kv_transfer_params`). The script, its options and the way to run it on a GPU: "
        "`python -m benchmarks.bench_serve --help` (a GPU run: `--model NAME`, trace blocks "
        "unscaled, `--kvci-config '{\"ram_bytes\": ...}'`, `--server-args`, `--label`).",
        "",
        f"- vLLM {report['vllm_version']}, {report['cpus']} CPUs (1-minute load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end); {env}.",
        f"- Model: {'the tiny random-weight model (float32)' if model['tiny'] else model['name']}"
        + (f"; vLLM's KV cache {blocks} blocks of {trace['block_tokens']} tokens" if blocks
           else "") + f"; kvci's extra config {json.dumps(shown)}" + _source(report) + ".",
        f"- Slice of `{trace['file']}` (sha256 `{trace['sha256']}…`): {trace['requests']} "
        f"requests of {len(trace['sessions'])} sessions, {trace['distinct_blocks']:,} distinct "
        f"blocks, a 512-token trace block as {trace['block_tokens']} tokens, "
        f"{trace['prompt_tokens']:,} prompt tokens, sent over {trace['span_s']:.0f} s "
        f"(trace time / {trace['time_scale']:g})"
        + (f", outputs capped at {trace['max_output_tokens']} tokens" if
           trace["max_output_tokens"] else "") + ".",
        "- Turn classes by how the session's previous turn ended: `tool_return` after a tool "
        "call, `human_return` after an answer, `first` the session's first request here. The "
        "client sends open loop at the trace's times, so requests/s is the trace's own unless a "
        "server falls behind; TTFT is where a server's cache shows. Prompt tokens and hits: "
        "the server's `/metrics` counters over the run.",
        "",
        "| server | completed / failed | TTFT p50 / p90 (ms) | tool_return TTFT p50 / p90 (ms) "
        "| human_return p50 / p90 (ms) | first p50 / p90 (ms) | requests/s | output tokens/s "
        "| prompt tokens | vLLM prefix-cache hit tokens | connector hit tokens |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, run in report["runs"].items():
        s, t, c = run["summary"], run["ttft_by_turn"], run["counters"]
        turn = {k: f"{_ms(v['p50_ms'])} / {_ms(v['p90_ms'])} ({v['n']})" for k, v in t.items()}
        lines.append(
            f"| {name} | {s['completed']} / {s['failed']} | {_ms(s['p50_ttft_ms'])} / "
            f"{_ms(s['p90_ttft_ms'])} | {turn['tool_return']} | {turn['human_return']} | "
            f"{turn['first']} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{c['vllm:prompt_tokens_total']:,.0f} | {c['vllm:prefix_cache_hits_total']:,.0f} | "
            f"{c['vllm:external_prefix_cache_hits_total']:,.0f} |")
    ratios = comparison(report)
    lines += [
        "",
        "Requests per class in parentheses. vLLM alone over kvci (higher: kvci faster): TTFT "
        f"p50 {_x(ratios['ttft_p50_vllm_over_kvci'])}, p90 {_x(ratios['ttft_p90_vllm_over_kvci'])}"
        f"; tool_return TTFT p50 {_x(ratios['tool_return_ttft_p50_vllm_over_kvci'])}, p90 "
        f"{_x(ratios['tool_return_ttft_p90_vllm_over_kvci'])}. kvci over vLLM alone: requests/s "
        f"{_x(ratios['request_throughput_kvci_over_vllm'])}, output tokens/s "
        f"{_x(ratios['output_throughput_kvci_over_vllm'])}.",
    ]
    return lines
