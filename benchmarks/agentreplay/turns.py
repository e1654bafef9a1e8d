"""The chat requests of an agent-trace slice, as ``benchmarks/agent_replay.py`` sends them.

The slice is ``benchmarks.benchserve.trace``'s (the first sessions of the trace, 512-token blocks
scaled to ``block_tokens``, timestamps compressed), kept with each request's own ``stop``. A
trace block becomes ``block_tokens`` words of the tiny model's corpus (each one token with its
leading space), drawn by a generator seeded with the block's hash id, so that a prompt extends
an earlier one exactly where the trace's block chains do; the last block keeps its scaled
length. Each request is one chat turn (a user message holding the whole prompt) with the same
tool list, so that every prompt starts with the same system turn.

A ``tool_use`` turn is forced to call the tool: a structured-output regex for a whole
``<tool_call>{json}</tool_call>`` and a +100 logit bias on the ``<tool_call>`` token, so the
output starts with the marker kvci detects and vLLM's ``hermes`` parser reads a call. Every
other turn gets a -100 bias on the marker: it never writes one (kvci's word: no tool call).
Greedy decoding (temperature 0, a fixed seed) makes the outputs comparable across servers. Each
request names its session to kvci (``kv_transfer_params.kvci.session_id``; without one kvci
learns no return gaps and retains nothing automatically) unless told not to; nothing says
whether a turn called a tool: kvci reads that from the output ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.benchserve.trace import AgentRequest, TimedRow, to_timed_trace
from kvci_plugin.tinymodel import _WORDS

TOOL_NAME = "bash"
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {}}}}]
# The forced call, whole (the grammar ends the output after it); the model picks the command's
# letters, so its outputs still say whether two servers computed the same logits.
TOOL_CALL_REGEX = (r'<tool_call>\{"name": "' + TOOL_NAME
                   + r'", "arguments": \{"cmd": "[a-z]{1,8}"\}\}</tool_call>')
TOOL_CALL_MAX_TOKENS = 64  # room for the forced call (at most about 47 tokens)
MARKER_BIAS = 100


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the slice: its timed row and its own end (``stop``)."""

    row: TimedRow
    stop: str

    @property
    def forced_tool_call(self) -> bool:
        return self.stop == "tool_use"


def slice_turns(requests: Sequence[AgentRequest], block_tokens: int, time_scale: float,
                max_output_tokens: int | None, duration_s: float | None) -> list[Turn]:
    """The slice's turns in the trace's order, cut after ``duration_s`` replayed seconds."""
    rows = to_timed_trace(requests, block_tokens, time_scale, max_output_tokens)
    turns = [Turn(row, request.stop) for row, request in zip(rows, requests)]
    if duration_s is None:
        return turns
    return [t for t in turns if t.row.timestamp_ms <= duration_s * 1000.0]


def block_text(hash_id: int, words: int) -> str:
    """``words`` corpus words (one token each, with their leading space), fixed by ``hash_id``."""
    rng = random.Random(hash_id)
    return "".join(" " + rng.choice(_WORDS) for _ in range(words))


def prompt_text(row: TimedRow, block_tokens: int) -> str:
    """The row's prompt: one text per block, every block full but the last."""
    ids = row.hash_ids
    last = row.input_length - (len(ids) - 1) * block_tokens
    return "".join(block_text(h, block_tokens if i < len(ids) - 1 else last)
                   for i, h in enumerate(ids))


def chat_body(turn: Turn, model: str, block_tokens: int, marker_id: int,
              session_ids: bool = True) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body of one turn (streamed, with usage and output ids); with
    ``session_ids`` it names its session to kvci (``kv_transfer_params.kvci.session_id``, as a
    client names its conversation; it says nothing of tool calls)."""
    forced = turn.forced_tool_call
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(turn.row, block_tokens)}],
        "tools": TOOLS, "tool_choice": "auto",
        "temperature": 0.0, "seed": 0,
        "max_tokens": max(turn.row.output_length, TOOL_CALL_MAX_TOKENS) if forced
        else turn.row.output_length,
        "logit_bias": {str(marker_id): MARKER_BIAS if forced else -MARKER_BIAS},
        "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if forced:
        body["structured_outputs"] = {"regex": TOOL_CALL_REGEX}
    if session_ids:
        body["kv_transfer_params"] = {"kvci": {"session_id": turn.row.session}}
    return body


def by_session(turns: Sequence[Turn]) -> dict[str, list[int]]:
    """Indices of ``turns`` per session, in the order each session sends them."""
    out: dict[str, list[int]] = {}
    for index, turn in enumerate(turns):
        out.setdefault(turn.row.session, []).append(index)
    for indices in out.values():
        if [turns[i].row.turn for i in indices] != list(range(len(indices))):
            raise ValueError("a session's turns are not numbered 0, 1, ... in the slice's order")
    return out
