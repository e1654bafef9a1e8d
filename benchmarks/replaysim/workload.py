"""A trace slice as engine prompts: one 512-token trace block becomes one 32-token engine block.

Each hash id gets its own deterministic token ids, so two prompts share an engine prefix exactly
where their trace chains share hash ids (the ids are chained: an equal id means an equal prefix),
and vLLM's prefix cache and kvci's keys see the trace's sharing, no more and no less. Every block
but the last is full; the last keeps its fraction of 512 tokens, scaled to 32 and rounded up (a
partial block is never cached by either, as the trace's partial block only ever hits as the
tail of an identical prompt).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.policysim.engine_view import scaled_prompt_tokens
from benchmarks.policysim.sessions import SessionTracker, session_contexts
from benchmarks.policysim.trace import TraceRequest

ENGINE_BLOCK_TOKENS = 32  # vLLM on CPU needs a multiple of 32
FIRST_TOKEN_ID = 2  # 0 and 1 are the tiny model's BOS and EOS


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    token_ids: tuple[int, ...]
    max_tokens: int
    # The conversation the simulator infers it continues (``SessionTracker`` threads, as
    # ``policy_sim`` infers them by default): the id a client sends per conversation.
    session_id: str | None


def engine_tokens(input_length: int, blocks: int) -> int:
    """Engine prompt length of a trace input of ``input_length`` tokens in ``blocks`` blocks."""
    return scaled_prompt_tokens(input_length, blocks, ENGINE_BLOCK_TOKENS)


def block_token_ids(hash_id: int, vocab_size: int, seed: int = 0) -> list[int]:
    rng = random.Random(f"{seed}:{hash_id}")
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(ENGINE_BLOCK_TOKENS)]


def engine_prompts(
    requests: Sequence[TraceRequest], vocab_size: int, max_output_tokens: int
) -> list[EnginePrompt]:
    blocks: dict[int, list[int]] = {}
    prompts = []
    for request, context in zip(requests, session_contexts(requests, SessionTracker(threads=True))):
        chain = request.hash_ids
        tokens: list[int] = []
        for hash_id in chain:
            if hash_id not in blocks:
                blocks[hash_id] = block_token_ids(hash_id, vocab_size)
            tokens.extend(blocks[hash_id])
        del tokens[engine_tokens(request.input_length, len(chain)):]
        prompts.append(
            EnginePrompt(
                tuple(tokens),
                max(1, min(request.output_length, max_output_tokens)),
                context.session_id,
            )
        )
    return prompts


def write_retimed(
    requests: Sequence[TraceRequest], arrivals_s: Sequence[float], path: Path
) -> None:
    """The slice with each request at the time the engine received it (ms since the first), so
    the simulator's policy sees the idle ages the engine's did."""
    if len(requests) != len(arrivals_s):
        raise ValueError(f"{len(requests)} requests but {len(arrivals_s)} arrival times")
    start = arrivals_s[0]
    with path.open("w", encoding="utf-8") as out:
        for request, arrival in zip(requests, arrivals_s):
            out.write(json.dumps({"timestamp": round((arrival - start) * 1000.0),
                                  "input_length": request.input_length,
                                  "output_length": request.output_length,
                                  "hash_ids": list(request.hash_ids)}) + "\n")
