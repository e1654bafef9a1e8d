"""The agent-trace slice as vLLM's ``timed_trace`` dataset (``benchmarks/benchserve/trace.py``,
driven by ``benchmarks/bench_serve.py``), and the report's reading of a ``vllm bench serve``
result, without an engine: which requests and sessions the slice takes, in what order, their
times and prompt lengths, and that vLLM's own ``TimedTrace`` reads the written file back into
prompts of those lengths, at those times, sharing a prefix exactly where the trace's chains do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import render_results
from benchmarks.bench_serve import parse_metrics
from benchmarks.benchserve.report import bench_serve_section, comparison, run_summary
from benchmarks.benchserve.trace import (
    SEC_MULTIPLIER,
    AgentRequest,
    read_agent_trace,
    select_sessions,
    to_timed_trace,
    within,
    write_timed_trace,
)
from benchmarks.policysim.trace import BLOCK_TOKENS


def agent(at_ms: int, chain: list[int], session: str, stop: str = "tool_use",
          short_by: int = 100, output: int = 200) -> AgentRequest:
    return AgentRequest(at_ms, len(chain) * BLOCK_TOKENS - short_by, output, tuple(chain), stop,
                        session)


# Three sessions interleaved, as the agent trace interleaves them; "c" starts with a prompt too
# long for a small context, "b" grows past it at its third turn.
TRACE = [
    agent(10_000, [1, 2], "a"),
    agent(12_000, [10], "b", stop="end_turn"),
    agent(15_000, [1, 2, 3], "a", stop="end_turn"),
    agent(16_000, [20, 21, 22, 23, 24, 25], "c"),
    agent(20_000, [10, 11], "b", stop=""),
    agent(30_000, [1, 2, 3, 4], "a"),
    agent(31_000, [10, 11, 12, 13, 14], "b"),
    agent(40_000, [1, 2, 3, 4, 5], "a"),
]


def write_trace(path: Path, requests: list[AgentRequest]) -> Path:
    path.write_text("".join(json.dumps({
        "timestamp": r.timestamp_ms, "input_length": r.input_length,
        "output_length": r.output_length, "hash_ids": list(r.hash_ids), "stop": r.stop,
        "session": r.session}) + "\n" for r in requests), encoding="utf-8")
    return path


def test_the_trace_is_read_in_its_order_and_checked(tmp_path: Path) -> None:
    assert read_agent_trace(write_trace(tmp_path / "t.jsonl", TRACE)) == TRACE
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1,
                               "hash_ids": [1], "session": "a"}) + "\n")
    with pytest.raises(ValueError, match="one id per"):
        read_agent_trace(bad)
    back = write_trace(tmp_path / "back.jsonl", [TRACE[1], TRACE[0]])
    with pytest.raises(ValueError, match="back in time"):
        read_agent_trace(back)


def test_the_slice_takes_whole_sessions_in_the_trace_order() -> None:
    assert select_sessions(TRACE, sessions=2) == [r for r in TRACE if r.session in "ab"]
    # turns: each session's first requests; skip: the first session left out
    assert select_sessions(TRACE, sessions=2, turns=2) == [TRACE[0], TRACE[1], TRACE[2],
                                                           TRACE[4]]
    assert [r.session for r in select_sessions(TRACE, sessions=5, skip_sessions=1)] == [
        "b", "c", "b", "b"]
    # a context bound: "c" never fits and is not counted; "b" is cut before its long turn and
    # nothing of it comes after, though a later "a" turn still fits
    bound = 4 * BLOCK_TOKENS
    sliced = select_sessions(TRACE, sessions=3, max_input_tokens=bound)
    assert sliced == [TRACE[0], TRACE[1], TRACE[2], TRACE[4], TRACE[5]]
    with pytest.raises(ValueError, match="no session"):
        select_sessions(TRACE, sessions=1, max_input_tokens=10)


def test_conversion_scales_times_lengths_and_classes_turns() -> None:
    rows = to_timed_trace(TRACE, block_tokens=32, time_scale=4.0, max_output_tokens=64)
    # times from the slice's first request, 4x faster, in ms
    assert [r.timestamp_ms for r in rows] == [0, 500, 1250, 1500, 2500, 5000, 5250, 7500]
    # every block but the last full (32), the last its fraction of 512 rounded up: 412 -> 26
    assert [r.input_length for r in rows] == [32 * (len(r.hash_ids) - 1) + 26 for r in TRACE]
    assert [r.trace_input_length for r in rows] == [r.input_length for r in TRACE]
    assert [r.hash_ids for r in rows] == [r.hash_ids for r in TRACE]
    assert {r.output_length for r in rows} == {64}
    assert [(r.session, r.turn, r.turn_class) for r in rows] == [
        ("a", 0, "first"), ("b", 0, "first"), ("a", 1, "tool_return"), ("c", 0, "first"),
        ("b", 1, "human_return"), ("a", 2, "human_return"), ("b", 2, "unrecorded"),
        ("a", 3, "tool_return")]
    # unscaled (a real model's 512-token blocks): the trace's own lengths and outputs
    same = to_timed_trace(TRACE)
    assert [(r.input_length, r.output_length) for r in same] == [
        (r.input_length, r.output_length) for r in TRACE]
    assert [r.timestamp_ms for r in within(rows, 2.5)] == [0, 500, 1250, 1500, 2500]


class _Tokenizer:
    """What vLLM's TimedTrace asks of a tokenizer."""

    all_special_ids = [0, 1]

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(1024)}


def test_vllms_timed_trace_reads_the_slice_back(tmp_path: Path) -> None:
    from vllm.benchmarks.datasets.datasets import TimedTrace

    rows = to_timed_trace(TRACE, block_tokens=32, time_scale=4.0, max_output_tokens=64)
    path = tmp_path / "timed_trace.jsonl"
    write_timed_trace(rows, path)
    dataset = TimedTrace(dataset_path=str(path), random_seed=0,
                         timed_trace_chunk_hash_size=32,
                         timed_trace_sec_multiplier=SEC_MULTIPLIER,
                         timed_trace_label_timestamp="timestamp",
                         timed_trace_label_input_length="input_length",
                         timed_trace_label_output_length="output_length",
                         timed_trace_label_hash_ids="hash_ids")
    samples = dataset.sample(tokenizer=_Tokenizer(), num_requests=len(rows))
    assert [s.prompt_len for s in samples] == [len(s.prompt) for s in samples]
    assert [s.prompt_len for s in samples] == [r.input_length for r in rows]
    assert [s.expected_output_len for s in samples] == [64] * len(rows)
    assert [s.timestamp for s in samples] == pytest.approx(
        [r.timestamp_ms / 1000.0 for r in rows])
    # session "a": each turn extends the last one's prompt by its full blocks
    a = [s.prompt for s, r in zip(samples, rows) if r.session == "a"]
    for before, after in zip(a, a[1:]):
        full = (len(before) // 32) * 32
        assert after[:full] == before[:full]
        assert after[full:len(before)] != before[full:]  # the partial last block differs
    # different sessions share nothing
    assert samples[0].prompt[:32] != samples[1].prompt[:32]


def _raw(ttfts: list[float], rows: list, **summary: float) -> dict:
    return {"input_lens": [r.input_length for r in rows], "ttfts": ttfts,
            "errors": [""] * len(rows), "p50_ttft_ms": 100.0, "p90_ttft_ms": 200.0,
            "request_throughput": 1.0, "output_throughput": 10.0, "completed": len(rows),
            "failed": 0, **summary}


def test_the_report_classes_ttfts_by_turn_and_refuses_other_prompts() -> None:
    rows = to_timed_trace(TRACE, block_tokens=32)
    ttfts = [0.1 * (i + 1) for i in range(len(rows))]
    run = run_summary(_raw(ttfts, rows), rows, parse_metrics(""), 1.0)
    tool = [ttfts[i] * 1000 for i, r in enumerate(rows) if r.turn_class == "tool_return"]
    assert run["ttft_by_turn"]["tool_return"]["n"] == 2
    assert run["ttft_by_turn"]["tool_return"]["p50_ms"] == pytest.approx(sum(tool) / 2)
    assert run["ttft_by_turn"]["first"]["n"] == 3
    shuffled = _raw(ttfts, rows)
    shuffled["input_lens"] = list(reversed(shuffled["input_lens"]))
    with pytest.raises(ValueError, match="not the slice's"):
        run_summary(shuffled, rows, {}, 1.0)


def test_metrics_are_summed_over_labels() -> None:
    page = ("# HELP x\nvllm:prefix_cache_hits_total{engine=\"0\"} 96.0\n"
            "vllm:kvci_hit_tokens_total{tier=\"ram\"} 64.0\n"
            "vllm:kvci_hit_tokens_total{tier=\"disk\"} 32.0\nother_total 5\n")
    got = parse_metrics(page)
    assert got["vllm:prefix_cache_hits_total"] == 96.0
    assert got["vllm:kvci_hit_tokens_total"] == 96.0


def test_the_section_renders_from_a_report(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rows = to_timed_trace(TRACE, block_tokens=32, time_scale=4.0)
    counters = parse_metrics("")
    runs = {name: run_summary(_raw([0.2 if name == "vllm" else 0.1] * len(rows), rows), rows,
                              counters, 1.0) for name in ("vllm", "kvci")}
    report = {
        "report_format": "kvci-bench-serve/1", "command": "python -m benchmarks.bench_serve",
        "runtime_s": 1.0, "vllm_version": "0.32.0", "cpus": 2, "load_average": [1.0, 1.0],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "model": {"name": "tiny", "tiny": True},
        "trace": {"file": "t.jsonl", "sha256": "0" * 16, "sessions": ["a", "b", "c"],
                  "requests": len(rows), "span_s": 1.9, "block_tokens": 32, "time_scale": 4.0,
                  "max_output_tokens": None, "distinct_blocks": 17, "prompt_tokens": 1000},
        "kv_transfer_config": {"kv_connector_extra_config": {"ram_bytes": 1}},
        "servers": {"vllm": {"argv": ["python", "--num-gpu-blocks-override", "9"]}},
        "runs": runs,
    }
    report["comparison"] = comparison(report)
    assert report["comparison"]["tool_return_ttft_p90_vllm_over_kvci"] == pytest.approx(2.0)
    text = "\n".join(bench_serve_section(Path("bench_serve_cpu.json"), report))
    assert "## bench_serve_cpu" in text and "9 blocks of 32 tokens" in text
    assert "tool_return TTFT p50 2.00x" in text
    # the results README takes it from its folder, and no other loader calls it foreign
    (tmp_path / "bench_serve_cpu.json").write_text(json.dumps(report), encoding="utf-8")
    assert render_results.main(["--results", str(tmp_path)]) == 0
    assert "## bench_serve_cpu" in (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "skipping" not in capsys.readouterr().err
