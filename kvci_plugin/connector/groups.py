"""The KV cache groups of a hybrid model, and what each keeps and needs of a prefix.

vLLM's hybrid KV cache manager (HMA) gives each kind of attention layer a group of its own, with
a block table of its own over one shared block pool: a full-attention group holds every block of
a request, a sliding-window group only the blocks its window still reads (the others are vLLM's
null block). kvci keeps, per group, exactly what a later hit reads:

- a page is one group's layers at one block (every group's pages have the same size: vLLM pads
  the groups to one page size), keyed by the block's prefix key for group 0 and by a key derived
  from it for every other group, so one group's page never loads into another's layers;
- a full-attention group needs every block of a hit, a sliding-window group only the blocks that
  vLLM does not skip for it — the same rule as vLLM's `SlidingWindowManager`
  (`get_num_skipped_tokens`: the tokens before the window of the next token to compute);
- a hit is as long as every group can serve: the longest run that all of them hold.

Imports no vllm: the connector builds the layout from vLLM's `KVCacheConfig`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvci_plugin.tiering.types import PageKey


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers and, for a sliding-window group, its window in tokens, or
    for a chunked local-attention group (Llama 4), its chunk."""

    layer_names: tuple[str, ...]
    window: int | None = None
    chunk: int | None = None

    @property
    def full(self) -> bool:
        return self.window is None and self.chunk is None

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """Leading blocks of a prefix of ``num_tokens`` this group never reads again: those
        before the window, or the chunk, of the next token (vLLM's `get_num_skipped_tokens`)."""
        if self.window is not None:
            return max(0, num_tokens - (self.window - 1)) // block_size
        if self.chunk is not None:
            return num_tokens // self.chunk * self.chunk // block_size
        return 0

    def describe(self) -> str:
        kind = ("full" if self.full else f"window{self.window}" if self.window is not None
                else f"chunk{self.chunk}")
        return f"{kind}:{','.join(self.layer_names)}"


@dataclass(frozen=True)
class GroupLayout:
    groups: tuple[KVGroup, ...]
    block_size: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache layout needs at least one group")

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def describe(self) -> str:
        """The layout in the namespace: KV of one layout never loads under another."""
        return ";".join(g.describe() for g in self.groups)

    def group_keys(self, keys: Sequence[PageKey]) -> list[list[PageKey]]:
        """Each group's page keys for the blocks ``keys`` name (group 0's are ``keys``)."""
        out = [list(keys)]
        for g in range(1, len(self.groups)):
            salt = b"kvci-group" + g.to_bytes(2, "big")
            out.append([hashlib.blake2b(k, digest_size=len(k), salt=salt).digest() for k in keys])
        return out

    def needed(self, g: int, first: int, last: int) -> range:
        """Blocks in [first, last) group ``g`` reads for a hit of ``last`` blocks."""
        return range(max(first, self.groups[g].skipped_blocks(last * self.block_size,
                                                               self.block_size)), last)

    def window_need(self, g: int) -> int:
        """Blocks a block-aligned hit reads of sliding group ``g`` at most (its window's blocks,
        ``cdiv(window - 1, block_size)``, or its chunk's); 0 for a full group."""
        group, bs = self.groups[g], self.block_size
        if group.window is not None:
            return -(-(group.window - 1) // bs)
        if group.chunk is not None:
            return -(-group.chunk // bs)
        return 0

    def boundaries(self, num_prompt_tokens: int, ladder_from: int = 0, interval: int = 0,
                   junctions: Sequence[int] = ()) -> list[int]:
        """The block boundaries at which a sliding group's window is worth copying during a
        prompt's prefill, ascending: hits start there once the window has moved on.

        - the exact repeat's, ``(N - 1) // bs`` (a hit never covers the last token), and the
          prompt's last full block ``N // bs`` (what a continuation re-sends);
        - a ladder of power-of-two block counts from ``ladder_from`` tokens and four windows
          (0: none): a request sharing P blocks of the prompt hits more than P / 2;
        - one every ``interval`` tokens (0: none), and the ``junctions`` given (blocks).
        None when every group is full (they keep every block)."""
        sliding = [g for g, group in enumerate(self.groups) if not group.full]
        bs = self.block_size
        last = num_prompt_tokens // bs
        if not sliding or last < 1:
            return []
        repeat = (num_prompt_tokens - 1) // bs
        out = {repeat, last}
        if ladder_from > 0:
            rung = 1
            while rung < max(4 * max(map(self.window_need, sliding)), -(-ladder_from // bs)):
                rung *= 2
            while rung <= repeat:
                out.add(rung)
                rung *= 2
        if interval > 0:
            step = max(1, interval // bs)
            out.update(range(step, repeat + 1, step))
        out.update(j for j in junctions if 0 < j <= last)
        return sorted(b for b in out if b > 0)

    def longest_run(self, group_keys: list[list[PageKey]], first: int, cap: int,
                    held: Callable[[Sequence[PageKey]], int]) -> int:
        """The longest hit (in blocks, at most ``cap``) every group can serve past ``first``, or
        ``first``; ``held(keys)`` is how many leading ``keys`` a tier holds."""
        last = cap
        for g, group in enumerate(self.groups):
            if group.full:
                last = min(last, held(group_keys[g][:cap]))
        sliding = [g for g, group in enumerate(self.groups) if not group.full]
        while last > first:
            if all(held(group_keys[g][need.start:need.stop]) == len(need)
                   for g in sliding for need in (self.needed(g, first, last),)):
                return last
            last -= 1
        return first
