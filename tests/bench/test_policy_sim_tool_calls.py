"""policy_sim replays the engine's word on a turn's end: a trace's ``stop`` becomes the word the
connector reads from the output's tool-call markers, and a kept tool-call turn is retained through
the real RAM index and ``Retentions`` until its session's next request or its TTL."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.policysim.kvci_tier import KVCITier, page_key, replay_kvci
from benchmarks.policysim.sessions import SessionTracker, session_contexts
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest, engine_word, load_trace

RATE = 10_000.0


def turn(chain: list[int], at_s: float, stop: str | None) -> TraceRequest:
    return TraceRequest(int(at_s * 1000), len(chain) * BLOCK_TOKENS - 100, 200, tuple(chain), stop)


def agent_trace(stop_a: str | None, filler_stop: str | None) -> list[TraceRequest]:
    """Session A ends a turn on a tool call, three one-off requests pass through a tier too small
    for all of them, and A comes back 10 s later with its context extended."""
    a = [1, 2, 3, 4]
    fillers = [[100 + 10 * n + b for b in range(4)] for n in range(3)]
    return [
        turn(a, 0.0, stop_a),
        *(turn(chain, 2.0 + 2 * n, filler_stop) for n, chain in enumerate(fillers)),
        turn([*a, 5], 10.0, stop_a),
    ]


def run(requests: list[TraceRequest], capacity: int = 8) -> tuple[KVCITier, int]:
    contexts = session_contexts(requests, SessionTracker(threads=True))
    tier = KVCITier(capacity, prefill_tokens_per_second=RATE)
    tally = replay_kvci(requests, contexts, tier)
    return tier, tally.ram_saved_tokens


def test_stop_becomes_the_engines_word() -> None:
    assert engine_word("tool_use") is True and engine_word("tool_calls") is True
    assert engine_word("end_turn") is False and engine_word("stop") is False
    assert engine_word("") is None and engine_word(None) is None
    assert engine_word("max_tokens") is None  # cut off: the trace does not say where


def test_a_tool_call_turn_is_retained_through_the_pause_and_released_on_return() -> None:
    tier, saved = run(agent_trace("tool_use", "end_turn"))
    assert saved == 3 * BLOCK_TOKENS  # A's full blocks came back (its fourth was partial)
    stats = tier.stats()
    assert stats["engine_word"] == {"no_tool_call": 3, "tool_call": 2}
    retained = stats["retentions"]
    assert isinstance(retained, dict)
    assert retained["granted"] == 2 and retained["released"] == 1 and retained["expired"] == 0
    # The return's own turn is retained in turn, its pages pinned.
    assert tier.retentions.stats().retentions == 1
    assert tier.index.longest_prefix([page_key(b) for b in (1, 2, 3, 4, 5)], "trace") == 4


def test_without_the_word_the_same_pause_loses_the_context() -> None:
    """The control: the same trace with no stop recorded retains nothing, and the one-off
    requests take A's room."""
    tier, saved = run(agent_trace(None, None))
    assert saved == 0
    stats = tier.stats()
    assert "engine_word" not in stats and "retentions" not in stats
    assert tier.retentions.stats().retentions == 0


def test_a_retention_ends_at_its_ttl_when_the_session_never_comes_back() -> None:
    requests = [turn([1, 2, 3], 0.0, "tool_use"), turn([50, 51], 1.0, "end_turn"),
                turn([60, 61], 100.0, "end_turn")]
    tier, _ = run(requests)
    retained = tier.stats()["retentions"]
    assert isinstance(retained, dict)
    assert retained["granted"] == 1 and retained["expired"] == 1 and retained["released"] == 0
    assert tier.retentions.stats().retained_bytes == 0


def test_retention_holds_the_tier_against_newcomers_but_never_past_its_share() -> None:
    """A retained context is not evicted for a newcomer; one larger than the tier is never
    kept, so nothing is retained for it."""
    requests = [turn([1, 2, 3, 4], 0.0, "tool_use"), turn([9, 8, 7, 6], 1.0, "tool_use"),
                turn([1, 2, 3, 4, 5], 5.0, "tool_use")]
    tier, saved = run(requests, capacity=5)
    assert saved == 3 * BLOCK_TOKENS  # the newcomer did not displace the retained context
    big, _ = run([turn(list(range(1, 12)), 0.0, "tool_use")], capacity=5)
    assert big.retentions.stats().retentions == 0


def test_a_trace_without_stop_replays_exactly_as_before(tmp_path: Path) -> None:
    """The same requests with the stop field dropped and with ``stop`` empty (not recorded):
    the same saved tokens, outcomes and policy figures."""
    worded = agent_trace("", "")
    plain = [dataclasses.replace(r, stop=None) for r in worded]
    first, saved_first = run(worded)
    second, saved_second = run(plain)
    assert saved_first == saved_second
    assert first.stats() == second.stats()


def test_load_trace_reads_stop_and_refuses_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "agent.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2],
             "stop": "tool_use", "session": "s1"},
            {"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [r.stop for r in load_trace(path)] == ["tool_use", None]
    rows[1]["stop"] = 3
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match="stop must be a string"):
        load_trace(path)
