"""A slice of an agent trace as the dataset ``vllm bench serve --dataset-name timed_trace`` reads.

The trace is Mooncake format (``../shared/traces/README.md``): one JSON object a line, ms
``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks (chained: an
equal id means an equal prefix) and, in the agent trace, ``stop`` and ``session``.

vLLM's ``timed_trace`` dataset (``vllm/benchmarks/datasets/datasets.py``, ``TimedTrace``, the same
in 0.32 and 0.34) expands every hash id into ``--timed-trace-chunk-hash-size`` token ids drawn
from the tokenizer's vocabulary, seeded by the id (the last chunk cut to what ``input_length``
leaves), and sends each request at its ``timestamp`` times ``--timed-trace-sec-multiplier``
seconds after the run's start, open loop (``--self-timed``, its default), with EOS ignored so
that each output runs to ``output_length``. Scaling a trace block down to ``block_tokens`` is
therefore a matter of the lengths: every block but the last stays full (``block_tokens``), the last
keeps its fraction of 512 tokens, rounded up, as ``benchmarks/replay.py`` scales a slice
(``benchmarks.policysim.engine_view.scaled_prompt_tokens``); ``hash_ids`` are kept as they are,
so prompts share a prefix exactly where the trace's chains do.

The slice: the first ``sessions`` sessions to start in the trace, each its first ``turns``
requests and cut before its first request longer than ``max_input_tokens`` (a model's context
bounds it: a session's later turns extend its earlier ones, so nothing after that fits either).
Timestamps start at 0 at the slice's first request and run ``time_scale`` times faster;
``within`` keeps the requests of the first seconds of the replay (a human's pause in the
agent trace can last an hour).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.policysim.engine_view import scaled_prompt_tokens
from benchmarks.policysim.trace import BLOCK_TOKENS

# The timed_trace flags that read this module's rows: ms timestamps, chunks of the engine's size.
SEC_MULTIPLIER = 0.001
# How a turn's TTFT is classed: by how the session's previous turn in the slice ended.
TURN_CLASSES = ("first", "tool_return", "human_return", "unrecorded")
_AFTER = {"tool_use": "tool_return", "end_turn": "human_return"}


@dataclass(frozen=True, slots=True)
class AgentRequest:
    """One request of the agent trace, as read."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    stop: str
    session: str


@dataclass(frozen=True, slots=True)
class TimedRow:
    """One request of the converted slice: a ``timed_trace`` row and what the report classes."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str
    turn: int  # its place in its session's slice, from 0
    turn_class: str  # one of TURN_CLASSES
    trace_input_length: int

    def row(self) -> dict[str, Any]:
        """The JSONL object ``timed_trace`` reads (it ignores the fields it does not name)."""
        return {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids),
                "session": self.session, "turn": self.turn, "turn_class": self.turn_class}


def read_agent_trace(path: Path) -> list[AgentRequest]:
    """Every request of the trace, in its order, checked as the simulator's reader checks."""
    requests = []
    previous = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            row = json.loads(line)
            request = _request(row, where)
            if request.timestamp_ms < previous:
                raise ValueError(f"{where}: timestamp goes back in time")
            previous = request.timestamp_ms
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: the trace holds no requests")
    return requests


def _request(row: Any, where: str) -> AgentRequest:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for field in ("timestamp", "input_length", "output_length"):
        value = row.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {field} must be a non-negative int, got {value!r}")
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or len(hash_ids) != -(-row["input_length"] // BLOCK_TOKENS):
        raise ValueError(f"{where}: hash_ids must hold one id per {BLOCK_TOKENS}-token block")
    session = row.get("session")
    if not isinstance(session, str) or not session:
        raise ValueError(f"{where}: no session (an agent trace names each request's session)")
    stop = row.get("stop") or ""
    return AgentRequest(row["timestamp"], row["input_length"], row["output_length"],
                        tuple(hash_ids), str(stop), session)


def select_sessions(
    requests: Iterable[AgentRequest], sessions: int, turns: int | None = None,
    max_input_tokens: int | None = None, skip_sessions: int = 0,
) -> list[AgentRequest]:
    """The slice, in the trace's order: the first ``sessions`` sessions to start (after skipping
    ``skip_sessions``) whose first request fits, each cut as the module says."""
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    chosen: dict[str, int] = {}  # session -> requests taken
    closed: set[str] = set()  # sessions seen and not chosen, or cut
    skipped = 0
    out = []
    for request in requests:
        name = request.session
        if name in closed:
            continue
        fits = max_input_tokens is None or request.input_length <= max_input_tokens
        if name not in chosen:
            if not fits or skipped < skip_sessions or len(chosen) >= sessions:
                skipped += fits and skipped < skip_sessions
                closed.add(name)
                continue
            chosen[name] = 0
        if not fits or (turns is not None and chosen[name] >= turns):
            closed.add(name)
            continue
        chosen[name] += 1
        out.append(request)
    if not out:
        raise ValueError("no session of the trace fits the slice's bounds")
    return out


def to_timed_trace(
    requests: Sequence[AgentRequest], block_tokens: int = BLOCK_TOKENS, time_scale: float = 1.0,
    max_output_tokens: int | None = None,
) -> list[TimedRow]:
    """The slice as ``timed_trace`` rows: block lengths scaled to ``block_tokens``, timestamps
    from the slice's first request and divided by ``time_scale``, outputs capped."""
    if block_tokens < 1 or time_scale <= 0:
        raise ValueError("block_tokens must be >= 1 and time_scale > 0")
    if not requests:
        return []
    start = requests[0].timestamp_ms
    turns: dict[str, int] = {}
    last_stop: dict[str, str] = {}
    rows = []
    for request in requests:
        turn = turns.get(request.session, 0)
        turn_class = ("first" if turn == 0
                      else _AFTER.get(last_stop[request.session], "unrecorded"))
        output = request.output_length
        if max_output_tokens is not None:
            output = min(output, max_output_tokens)
        rows.append(TimedRow(
            timestamp_ms=round((request.timestamp_ms - start) / time_scale, 3),
            input_length=scaled_prompt_tokens(request.input_length, len(request.hash_ids),
                                              block_tokens),
            output_length=max(1, output), hash_ids=request.hash_ids, session=request.session,
            turn=turn, turn_class=turn_class, trace_input_length=request.input_length))
        turns[request.session] = turn + 1
        last_stop[request.session] = request.stop
    return rows


def within(rows: Sequence[TimedRow], duration_s: float | None) -> list[TimedRow]:
    """The rows sent in the first ``duration_s`` replayed seconds (all when None): the slice's
    tail cut, so every kept turn keeps its class."""
    if duration_s is None:
        return list(rows)
    return [row for row in rows if row.timestamp_ms <= duration_s * 1000.0]


def write_timed_trace(rows: Sequence[TimedRow], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row.row()) + "\n")
