"""The engine replay (``benchmarks/replay.py``): the scaled workload and the report without an
engine, then one real run of the three engines on a 12-request trace (no timed assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError

import kvci_plugin
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest, load_trace
from benchmarks.render_results import load_reports, render
from benchmarks.replaysim.render import load_replays
from benchmarks.replaysim.report import RUNS, EngineRun, ReplayReport, RequestSample
from benchmarks.replaysim.workload import (
    ENGINE_BLOCK_TOKENS,
    block_token_ids,
    engine_prompts,
    engine_tokens,
    write_retimed,
)

REPO_ROOT = Path(kvci_plugin.__file__).resolve().parents[1]
VOCAB = 1024


def req(
    chain: Sequence[int], at_ms: int = 0, short_by: int = 100, output: int = 200
) -> TraceRequest:
    return TraceRequest(at_ms, len(chain) * BLOCK_TOKENS - short_by, output, tuple(chain))


# Sessions interleaved with long one-off prompts that push earlier sessions out of vLLM's small
# KV cache (the longest request and one block more): their next turns can only hit in kvci.
SMOKE_CHAINS: list[list[int]] = [
    [0, 1, 2, 3], [0, *range(4, 14)], [0, *range(14, 24)], [0, 1, 2, 3, 24],
    [0, *range(25, 35)], [0, *range(35, 45)], [0, 1, 2, 3, 24, 45], [0, *range(4, 14), 46],
    [0, *range(47, 57)], [0, *range(57, 67)], [0, 1, 2, 3, 24, 45, 67], [0, *range(14, 24), 68],
]


def smoke_trace(path: Path) -> Path:
    rows = [{"timestamp": 100 * i, "input_length": len(c) * BLOCK_TOKENS - 100, "output_length": 50,
             "hash_ids": c} for i, c in enumerate(SMOKE_CHAINS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# --- the workload ---------------------------------------------------------------------------


@pytest.mark.parametrize(("input_length", "blocks", "tokens"), [
    (512, 1, 32), (1, 1, 1), (16, 1, 1), (17, 1, 2), (1024, 2, 64), (1025, 3, 65), (6758, 14, 423),
])
def test_engine_length_keeps_full_blocks_and_scales_the_last(
    input_length: int, blocks: int, tokens: int
) -> None:
    assert engine_tokens(input_length, blocks) == tokens


def test_prompts_share_exactly_the_prefixes_their_chains_share() -> None:
    trace = [req([0, 1, 2]), req([0, 1, 2, 3], short_by=0), req([0, 4]), req([5])]
    prompts = engine_prompts(trace, VOCAB, max_output_tokens=3)
    blocks = [
        [
            p.token_ids[i : i + ENGINE_BLOCK_TOKENS]
            for i in range(0, len(p.token_ids), ENGINE_BLOCK_TOKENS)
        ]
        for p in prompts
    ]
    assert [len(p.token_ids) for p in prompts] == [2 * 32 + 26, 4 * 32, 32 + 26, 26]
    # The partial last block is the head of its hash id's full block.
    assert blocks[1][2][:26] == blocks[0][2] and blocks[1][:2] == blocks[0][:2]
    assert blocks[2][0] == blocks[0][0] and blocks[2][1] != blocks[0][1][:26]
    assert blocks[3][0] != blocks[0][0][:26]
    assert all(2 <= t < VOCAB for p in prompts for t in p.token_ids)
    # The second continues the first's conversation; the others start their own.
    assert [p.session_id for p in prompts] == ["t1", "t1", "t2", "t3"]
    assert [p.max_tokens for p in prompts] == [3, 3, 3, 3]
    assert block_token_ids(7, VOCAB) == block_token_ids(7, VOCAB) != block_token_ids(8, VOCAB)


def test_the_retimed_slice_is_the_trace_at_the_engine_arrivals(tmp_path: Path) -> None:
    trace = [req([0, 1], at_ms=0), req([0, 1, 2], at_ms=5000), req([3], at_ms=5000)]
    path = tmp_path / "retimed.jsonl"
    write_retimed(trace, [10.0, 10.2504, 10.75], path)
    again = load_trace(path)
    assert [r.timestamp_ms for r in again] == [0, 250, 750]
    assert [(r.input_length, r.output_length, r.hash_ids) for r in again] == [
        (r.input_length, r.output_length, r.hash_ids) for r in trace]
    with pytest.raises(ValueError, match="3 requests but 2 arrival times"):
        write_retimed(trace, [0.0, 1.0], path)


def test_the_simulator_sees_the_outputs_the_engine_generated() -> None:
    from benchmarks.replay import as_run

    trace = [req([0, 1], output=200), req([0, 1, 2], output=1), req([3], output=0)]
    prompts = engine_prompts(trace, VOCAB, 2)
    ran = as_run(trace, 2)
    scale = BLOCK_TOKENS // ENGINE_BLOCK_TOKENS
    # The engine generates the capped output (at least one token); the simulator counts it in
    # trace tokens, and nothing else of the request changes.
    assert (
        [r.output_length for r in ran]
        == [p.max_tokens * scale for p in prompts]
        == [2 * scale, scale, scale]
    )
    assert [(r.timestamp_ms, r.input_length, r.hash_ids) for r in ran] == [
        (r.timestamp_ms, r.input_length, r.hash_ids) for r in trace]


# --- the report -----------------------------------------------------------------------------


def sample(cached: int, kvci: int, prompt: int = 64) -> RequestSample:
    return RequestSample(
        arrival_s=0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        kvci_tokens=kvci,
        kept=kvci > 0,
        ttft_s=0.01,
    )


def test_an_engine_run_adds_up_its_samples_by_source() -> None:
    run = EngineRun.of("kvci", {}, 1.0, 2.0, {}, [sample(32, 0), sample(64, 32), sample(0, 0)])
    assert (run.saved_vllm_tokens, run.saved_kvci_tokens, run.saved_tokens) == (64, 32, 96)
    assert run.requests_with_hit == 2 and run.prompt_tokens == 192
    assert EngineRun.model_validate(run.model_dump()) == run
    with pytest.raises(ValidationError, match="totals must be the ones its samples give"):
        EngineRun.model_validate({**run.model_dump(), "saved_kvci_tokens": 0})
    with pytest.raises(ValidationError, match="kvci_tokens <= cached_tokens"):
        sample(32, 64)


# --- one real run ---------------------------------------------------------------------------


@pytest.mark.engine
def test_three_engines_replay_the_slice_and_the_readme_shows_it(tmp_path: Path) -> None:
    trace = smoke_trace(tmp_path / "smoke.jsonl")
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.replay", "--trace", str(trace), "--requests", "12",
         "--budget", "0.5", "--max-output-tokens", "2", "--json", str(results / "replay.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = ReplayReport.model_validate_json((results / "replay.json").read_text(encoding="utf-8"))

    assert list(report.runs) == list(RUNS) and report.requests == 12
    prompt_tokens = {run.prompt_tokens for run in report.runs.values()}
    assert prompt_tokens == {
        sum(engine_tokens(len(c) * BLOCK_TOKENS - 100, len(c)) for c in SMOKE_CHAINS)
    }
    for run in report.runs.values():
        assert len(run.samples) == 12
        assert run.saved_vllm_tokens + run.saved_kvci_tokens == run.saved_tokens == sum(
            s.cached_tokens for s in run.samples)
        assert all(s.cached_tokens % ENGINE_BLOCK_TOKENS == 0 for s in run.samples)
    vllm, kvci, keep_all = (report.runs[name] for name in RUNS)
    assert vllm.saved_kvci_tokens == 0 and vllm.kvci_metrics == {}
    # Every request fits half the working set, so keeping everything kept every one, and the
    # sessions pushed out of vLLM's cache came back from kvci's RAM.
    assert keep_all.kept_requests == 12
    assert keep_all.kvci_metrics["vllm:kvci_checkpoints"] == 12
    assert keep_all.saved_kvci_tokens > 0
    assert keep_all.saved_tokens > vllm.saved_tokens
    assert keep_all.kvci_metrics["vllm:kvci_hit_tokens{tier=ram}"] == keep_all.saved_kvci_tokens
    assert kvci.kvci_metrics["vllm:kvci_hit_tokens{tier=ram}"] == kvci.saved_kvci_tokens
    assert report.simulated["lru"].saved_tokens > 0
    assert set(report.simulated_all) >= {"lru", "kvci"}
    assert report.simulated_all["lru"] == report.simulated["lru"].saved_tokens
    assert (
        report.simulated_product_lru is not None
        and report.simulated_product_lru.admitted_requests > 0
    )
    assert report.product_agreement is not None

    assert load_replays(results) == [(results / "replay.json", report)]
    readme = render(*load_reports(results), load_replays(results))
    assert "## replay" in readme and "kvci keeping everything" in readme
    assert (
        f"| {RUNS['kvci_keep_all']} | {keep_all.saved_vllm_tokens:,} | "
        f"{keep_all.saved_kvci_tokens:,} |"
        in readme
    )
