"""The chat requests of ``benchmarks/agent_replay.py`` (``benchmarks/agentreplay``), without an
engine: the tool-call marker forced on ``tool_use`` turns only, each session's turns in order,
prompts extending each other where the trace's block chains do, and the report's comparison and
README section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.agentreplay.report import (
    agent_replay_section,
    arm_summary,
    comparison,
    output_digest,
)
from benchmarks.agentreplay.turns import (
    MARKER_BIAS,
    TOOL_CALL_MAX_TOKENS,
    TOOL_CALL_REGEX,
    by_session,
    chat_body,
    prompt_text,
    slice_turns,
)
from benchmarks.benchserve.trace import AgentRequest
from benchmarks.policysim.trace import BLOCK_TOKENS

MARKER = 557


def agent(at_ms: int, chain: list[int], session: str, stop: str) -> AgentRequest:
    return AgentRequest(at_ms, len(chain) * BLOCK_TOKENS - 100, 200, tuple(chain), stop, session)


TRACE = [
    agent(10_000, [1, 2], "a", "tool_use"),
    agent(12_000, [10], "b", "end_turn"),
    agent(15_000, [1, 2, 3], "a", "end_turn"),
    agent(16_000, [10, 11], "b", "tool_use"),
    agent(30_000, [1, 2, 3, 4], "a", ""),
    agent(40_000, [10, 11, 12], "b", "tool_use"),
]


def test_marker_forced_on_tool_use_turns_only() -> None:
    turns = slice_turns(TRACE, 32, 10.0, 16, None)
    bodies = [chat_body(t, "m", 32, MARKER) for t in turns]
    for request, turn, body in zip(TRACE, turns, bodies):
        forced = request.stop == "tool_use"
        assert turn.forced_tool_call is forced
        assert ("structured_outputs" in body) is forced
        assert body["logit_bias"] == {str(MARKER): MARKER_BIAS if forced else -MARKER_BIAS}
        assert body["max_tokens"] == (TOOL_CALL_MAX_TOKENS if forced else 16)
        assert body["temperature"] == 0.0 and body["seed"] == 0 and body["stream"]
        assert body["tools"] == bodies[0]["tools"]  # every prompt starts alike
        assert body["kv_transfer_params"] == {"kvci": {"session_id": request.session}}
        assert "tool_call" not in str(body["kv_transfer_params"])
    assert "kv_transfer_params" not in chat_body(turns[0], "m", 32, MARKER, session_ids=False)
    call = '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>'
    assert re.fullmatch(bodies[0]["structured_outputs"]["regex"], call)
    assert not re.fullmatch(TOOL_CALL_REGEX, "ls")


def test_sessions_keep_their_order_and_prefixes() -> None:
    turns = slice_turns(TRACE, 32, 10.0, 16, None)
    assert by_session(turns) == {"a": [0, 2, 4], "b": [1, 3, 5]}
    assert [t.row.turn_class for t in turns] == ["first", "first", "tool_return",
                                                 "human_return", "human_return", "tool_return"]
    assert [t.row.timestamp_ms for t in turns] == [0, 200, 500, 600, 2000, 3000]
    texts = [prompt_text(t.row, 32) for t in turns]
    for earlier, later in ((0, 2), (2, 4), (1, 3), (3, 5)):
        full = len(turns[earlier].row.hash_ids) - 1  # the earlier prompt's full blocks
        shared = prompt_text(turns[later].row, 32).split()[: full * 32]
        assert texts[earlier].split()[: full * 32] == shared
    assert texts[0].split() != texts[1].split()[: len(texts[0].split())]
    assert [len(text.split()) for text in texts] == [t.row.input_length for t in turns]
    # the slice's duration cuts its tail
    assert len(slice_turns(TRACE, 32, 10.0, 16, 0.6)) == 4


def test_by_session_refuses_turns_out_of_order() -> None:
    turns = slice_turns(TRACE, 32, 10.0, 16, None)
    with pytest.raises(ValueError):
        by_session([turns[2], turns[0]])


def _result(ttft: float, ids: list[int], cached: int) -> dict:
    return {"sent_s": 0.0, "ttft_ms": ttft, "e2e_ms": ttft + 5, "token_ids": ids, "content": "",
            "tool_call": "", "finish_reason": "length", "prompt_tokens": 100,
            "cached_tokens": cached, "completion_tokens": len(ids), "error": ""}


def test_report_counts_mismatches_and_renders() -> None:
    turns = slice_turns(TRACE, 32, 10.0, 16, None)
    same = [_result(100.0, [5, 6], 0) for _ in turns]
    other = [_result(20.0, [5, 6] if i else [5, 7], 64) for i in range(len(turns))]
    assert output_digest(same[0]) != output_digest(other[0])
    runs = {"vllm": arm_summary(turns, same, {}, 1.0),
            "kvci": arm_summary(turns, other, {"vllm:kvci_hit_tokens_total": 64.0}, 1.0),
            "engine_holds": arm_summary(turns, other, {}, 1.0)}
    report = {"runs": runs, "runtime_s": 3.0, "command": "python -m benchmarks.agent_replay",
              "load_average": [1.0, 1.0], "env": {}, "vllm_version": "x", "cpus": 2,
              "kvci_ram_bytes": 2**20, "engine_blocks": {"pressured": 3, "engine_holds": 9},
              "trace": {"file": "t.jsonl", "sha256": "0", "requests": 6, "tool_use_turns": 3,
                        "sessions": ["a", "b"], "distinct_blocks": 7, "block_tokens": 32,
                        "prompt_tokens": 600, "span_s": 3.0, "time_scale": 10.0,
                        "max_output_tokens": 16}}
    report["comparison"] = comparison(report)
    assert report["comparison"]["output_mismatches_vs_vllm"] == {"kvci": 1, "engine_holds": 1}
    assert report["comparison"]["tool_return_ttft_p90_vllm_over_kvci"] == 5.0
    assert report["comparison"]["tool_return_ttft_p90_kvci_over_engine_holds"] == 1.0
    assert runs["kvci"]["cached_prompt_tokens"]["tool_return"] == 128
    text = "\n".join(agent_replay_section(Path("agent_replay_cpu.json"), report))
    assert "agent_replay_cpu" in text and "5.00x" in text and "`hit_tokens_total` 64" in text
