"""The report of ``benchmarks/agent_replay.py`` and its section of the results README."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.agentreplay.turns import Turn
from benchmarks.report_files import reports_of

SCHEMA = "kvci-agent-replay/1"
CLASSES = ("all", "tool_return", "human_return", "first")


def _percentiles(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50_ms": None, "p90_ms": None}
    p50, p90 = np.percentile(np.asarray(values, dtype=float), [50, 90])
    return {"n": len(values), "p50_ms": round(float(p50), 1), "p90_ms": round(float(p90), 1)}


def output_digest(result: dict[str, Any]) -> str:
    """What two servers must agree on for a request: output ids, call, text, finish reason."""
    key = json.dumps([result["token_ids"], result["tool_call"], result["content"],
                      result["finish_reason"]])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def arm_summary(turns: Sequence[Turn], results: Sequence[dict[str, Any]],
                counters: dict[str, float], wall_s: float) -> dict[str, Any]:
    """One arm's part of the report."""
    by_class: dict[str, list[float]] = {name: [] for name in CLASSES}
    cached = dict.fromkeys(CLASSES, 0)
    for turn, result in zip(turns, results):
        cls = turn.row.turn_class
        if result["ttft_ms"] is not None:
            by_class["all"].append(result["ttft_ms"])
            if cls in by_class:
                by_class[cls].append(result["ttft_ms"])
        cached["all"] += result["cached_tokens"] or 0
        if cls in cached:
            cached[cls] += result["cached_tokens"] or 0
    forced = [t.forced_tool_call for t in turns]
    return {
        "wall_s": round(wall_s, 1),
        "errors": sum(bool(r["error"]) for r in results),
        "ttft": {name: _percentiles(values) for name, values in by_class.items()},
        "cached_prompt_tokens": cached,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in results),
        "tool_calls_parsed": sum(r["finish_reason"] == "tool_calls" or bool(r["tool_call"])
                                 for r in results),
        "tool_calls_on_forced_turns": sum(bool(r["tool_call"]) for r, f in zip(results, forced)
                                          if f),
        "counters": counters,
        "requests": [{"session": t.row.session, "turn": t.row.turn, "class": t.row.turn_class,
                      "forced": t.forced_tool_call, "sent_s": r["sent_s"], "ttft_ms": r["ttft_ms"],
                      "cached_tokens": r["cached_tokens"], "prompt_tokens": r["prompt_tokens"],
                      "finish_reason": r["finish_reason"], "output": output_digest(r),
                      "error": r["error"] or None}
                     for t, r in zip(turns, results)],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def comparison(report: dict[str, Any]) -> dict[str, Any]:
    """Output mismatches against vLLM alone, and the tool-return TTFT ratios."""
    runs = report["runs"]
    out: dict[str, Any] = {"output_mismatches_vs_vllm": {}}
    if "vllm" in runs:
        base = [r["output"] for r in runs["vllm"]["requests"]]
        for name, run in runs.items():
            if name != "vllm":
                out["output_mismatches_vs_vllm"][name] = sum(
                    a != r["output"] for a, r in zip(base, run["requests"]))

    def p90(name: str, cls: str = "tool_return") -> float | None:
        return runs[name]["ttft"][cls]["p90_ms"] if name in runs else None

    for name in ("kvci", "kvci_keep_all"):
        out[f"tool_return_ttft_p90_{name}_over_engine_holds"] = _ratio(p90(name),
                                                                      p90("engine_holds"))
        out[f"tool_return_ttft_p90_vllm_over_{name}"] = _ratio(p90("vllm"), p90(name))
        out[f"ttft_p90_vllm_over_{name}"] = _ratio(p90("vllm", "all"), p90(name, "all"))
    return out


def load_agent_replays(results: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The agent replay reports in ``results``, by file name."""
    return reports_of(results, SCHEMA)


def _ram_tier(report: dict[str, Any]) -> str:
    """The kvci arms' RAM tier: ``kvci_ram_bytes`` holds every distinct block of the slice, unless
    ``--extra`` set another ``ram_bytes``."""
    every = report["kvci_ram_bytes"]
    ram = report.get("extra", {}).get("ram_bytes", every)
    if ram == every:
        return f"{ram / 2**20:.1f} MiB (every distinct block)"
    return f"{ram / 2**20:.1f} MiB ({ram / every:.0%} of the {every / 2**20:.1f} MiB of every " \
        "distinct block, set by `--extra`)"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ms(cell: dict[str, Any]) -> str:
    return f"{_num(cell['p50_ms'])} / {_num(cell['p90_ms'])} ({cell['n']})"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def agent_replay_section(path: Path, report: dict[str, Any]) -> list[str]:
    """The results README's section of one agent_replay report."""
    trace, runs, cmp = report["trace"], report["runs"], report["comparison"]
    load = report["load_average"]
    source = report.get("kvci_source") or {}
    lines = [
        f"## {path.stem}", "",
        f"Command (from the repository root, {report['runtime_s']:.0f} s): "
        f"`{report['command']}`", "",
        "Agent sessions through vLLM's OpenAI server (`--tool-call-parser hermes`) on the tiny "
        "model with tool-call tokens: `tool_use` turns forced to write `<tool_call>{...}"
        "</tool_call>` (structured-output regex and a +100 logit bias on the marker), other turns "
        "barred from it; streamed chat completions, greedy. Each session sends its turns at "
        "their trace times, after its previous turn finished; "
        + ("each names its session to kvci (`kv_transfer_params.kvci.session_id`), none says "
           "whether it called a tool. " if report.get("session_ids", False) else
           "no request names its session or says whether it called a tool. ")
        + "Arms, one server each: `vllm` "
        f"(vLLM alone, {report['engine_blocks']['pressured']} blocks of KV cache: paused "
        "sessions do not stay), `kvci_keep_all` (the same with kvci, `ram_policy: lru`), `kvci` "
        "(the same with kvci's defaults: tool-call turns retained automatically), `engine_holds` "
        f"(vLLM alone with {report['engine_blocks']['engine_holds']} blocks: its own cache holds "
        "every session).",
        "",
        f"- vLLM {report['vllm_version']}, {report['cpus']} CPUs (load {load[0]:.1f} at the "
        f"start, {load[1]:.1f} at the end); "
        + ", ".join(f"{k}={v}" for k, v in report["env"].items())
        + f"; kvci RAM tier {_ram_tier(report)}"
        + (f"; kvci from commit `{source['commit']}` with {source.get('changed_files', 0)} "
           "files of `kvci_plugin`/`csrc` changed" if source.get("commit") else "") + ".",
        f"- Slice of `{trace['file']}` (sha256 `{trace['sha256']}…`): {trace['requests']} "
        f"requests ({trace['tool_use_turns']} `tool_use`) of {len(trace['sessions'])} sessions, "
        f"{trace['distinct_blocks']:,} distinct blocks, a 512-token block as "
        f"{trace['block_tokens']} tokens, {trace['prompt_tokens']:,} prompt tokens over "
        f"{trace['span_s']:.0f} s (trace time / {trace['time_scale']:g}), outputs capped at "
        f"{trace['max_output_tokens']} tokens (a forced call: its length).",
        "",
        "| arm | TTFT p50 / p90 (ms), all | tool_return | human_return | first | cached prompt "
        "tokens | of them tool_return | connector hit tokens | tool calls parsed | errors | "
        "outputs ≠ vLLM alone |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    mismatches = cmp["output_mismatches_vs_vllm"]
    for name, run in runs.items():
        t, c = run["ttft"], run["counters"]
        lines.append(
            f"| {name} | {_ms(t['all'])} | {_ms(t['tool_return'])} | {_ms(t['human_return'])} "
            f"| {_ms(t['first'])} | {run['cached_prompt_tokens']['all']:,} / "
            f"{run['prompt_tokens']:,} | {run['cached_prompt_tokens']['tool_return']:,} | "
            f"{c.get('vllm:external_prefix_cache_hits_total', 0):,.0f} | "
            f"{run['tool_calls_parsed']} | {run['errors']} | "
            f"{mismatches.get(name, '-') if name != 'vllm' else '-'} |")
    kvci_counters = {k.removeprefix("vllm:kvci_"): v for k, v in
                     runs.get("kvci", {}).get("counters", {}).items()
                     if k.startswith("vllm:kvci_") and v}
    lines += [
        "",
        "TTFT cells: p50 / p90 (requests). Tool-return TTFT p90, kvci default over "
        f"engine_holds {_x(cmp.get('tool_return_ttft_p90_kvci_over_engine_holds'))} (kvci "
        "keeping everything "
        f"{_x(cmp.get('tool_return_ttft_p90_kvci_keep_all_over_engine_holds'))}); vLLM alone "
        f"over kvci default {_x(cmp.get('tool_return_ttft_p90_vllm_over_kvci'))} (over kvci "
        f"keeping everything {_x(cmp.get('tool_return_ttft_p90_vllm_over_kvci_keep_all'))}).",
        "",
        "kvci default's counters over the run: "
        + (", ".join(f"`{k}` {v:,.0f}" for k, v in sorted(kvci_counters.items())) or "none")
        + ".",
    ]
    return lines
