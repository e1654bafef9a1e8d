"""Reading a Mooncake-format trace (the FAST'25 release, kvcache-ai/Mooncake FAST25-release/traces).

One JSON object per line: ``timestamp`` (ms since the start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``: one id per 512-token block of the input, remapped so
that equal ids mean an equal prefix (the ids are chained, as a prefix cache's block keys are).
An agent trace may add ``stop``, how the turn ended (``tool_use``, ``end_turn``, or empty: not
recorded); ``engine_word`` turns it into the word the engine reads from the output's tool-call
markers (``kvci_plugin.request.tool_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tokens per hash id in the Mooncake release.
BLOCK_TOKENS = 512
# Stop reasons (Anthropic's and OpenAI's names) and whether the output held a tool call: what the
# engine's marker detection says of such a turn. Any other (``max_tokens``, empty): not known.
_TOOL_CALL_STOPS = {"tool_use": True, "tool_calls": True, "end_turn": False,
                    "stop_sequence": False, "stop": False}


def engine_word(stop: str | None) -> bool | None:
    """The engine's word on a turn that ended with ``stop``: True, its output held a tool-call
    marker; False, it did not; None, the trace does not say."""
    return _TOOL_CALL_STOPS.get(stop) if stop else None


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    stop: str | None = None  # how the turn ended, when the trace says (``engine_word``)

    @property
    def full_blocks(self) -> int:
        """Blocks a tier can hold: the full ones (an engine keys and keeps no partial block)."""
        return self.input_length // BLOCK_TOKENS

    @property
    def hit_blocks(self) -> int:
        """The most leading blocks a hit can cover: full ones, and never every token, since vLLM
        always computes the prompt's last token for its logits (``num_tokens - 1``)."""
        return max(0, self.input_length - 1) // BLOCK_TOKENS


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace (all when None), checked line by line."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    requests: list[TraceRequest] = []
    previous_ms = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            request = _parse(line, f"{path}:{number}")
            if request.timestamp_ms < previous_ms:
                raise ValueError(
                    f"{path}:{number}: timestamp {request.timestamp_ms} goes back in time "
                    f"(previous {previous_ms})"
                )
            previous_ms = request.timestamp_ms
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: the trace holds no requests")
    return requests


def _parse(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    timestamp = _count(row, "timestamp", where)
    input_length = _count(row, "input_length", where)
    output_length = _count(row, "output_length", where)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(_is_count(block) for block in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of non-negative ints")
    blocks = -(-input_length // BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise ValueError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length} (expected {blocks} "
            f"blocks of {BLOCK_TOKENS})"
        )
    stop = row.get("stop")
    if stop is not None and not isinstance(stop, str):
        raise ValueError(f"{where}: stop must be a string, got {stop!r}")
    return TraceRequest(timestamp, input_length, output_length, tuple(hash_ids), stop)


def _count(row: dict[str, Any], field: str, where: str) -> int:
    value = row.get(field)
    if not _is_count(value):
        raise ValueError(f"{where}: {field} must be a non-negative int, got {value!r}")
    return int(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
