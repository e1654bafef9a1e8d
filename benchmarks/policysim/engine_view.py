"""The engine a trace slice was replayed on (``benchmarks/replay.py``), as the simulator predicts
that replay: vLLM's own prefix cache in front of the tiers, and the engine's tokens per trace
block, the unit in which its connector measures what it observes.

vLLM's prefix cache, one request at a time: a request uses the cached leading blocks of its
prompt, and when it finishes every full block it computed or loaded stays cached, freed tail
first, so its root is the most recently used; a new block evicts the least recently used. kvci
loads only what lies past the blocks vLLM holds (``get_num_new_matched_tokens`` is told them).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from benchmarks.policysim.block_cache import leading_run
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest

PositiveInt = Annotated[int, Field(gt=0)]


class EngineView(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    block_tokens: PositiveInt  # engine tokens per trace block
    cache_blocks: PositiveInt  # blocks vLLM's prefix cache can hold (its pool less the null block)

    def prompt_tokens(self, request: TraceRequest) -> int:
        return scaled_prompt_tokens(request.input_length, len(request.hash_ids), self.block_tokens)

    def output_tokens(self, request: TraceRequest) -> int:
        return -(-request.output_length * self.block_tokens // BLOCK_TOKENS)


def scaled_prompt_tokens(input_length: int, blocks: int, block_tokens: int) -> int:
    """Engine tokens of a trace input of ``input_length`` tokens in ``blocks`` blocks, at
    ``block_tokens`` per block: every block but the last is full, the last keeps its fraction,
    rounded up."""
    last = input_length - (blocks - 1) * BLOCK_TOKENS
    return (blocks - 1) * block_tokens + -(-last * block_tokens // BLOCK_TOKENS)


class EngineCache:
    """vLLM's prefix cache in front of the tiers."""

    def __init__(self, view: EngineView) -> None:
        self._blocks = LRUBlockCache(view.cache_blocks)

    def lookup(self, request: TraceRequest) -> int:
        """Leading blocks of ``request`` the engine computes nothing for."""
        return leading_run(self._blocks, request.hash_ids[: request.hit_blocks])

    def finished(self, request: TraceRequest) -> None:
        for block in reversed(request.hash_ids[: request.full_blocks]):
            if block in self._blocks:
                self._blocks.touch(block)
            else:
                self._blocks.insert(block)
