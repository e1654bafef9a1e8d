"""KV events for cache-aware routers: vLLM's `BlockStored` / `BlockRemoved` for kvci's tiers.

llm-d's precise-prefix scorer and Dynamo's KV router route a request to the replica whose
events say it holds the prefix. kvci announces a block when a tier can load it (medium `CPU` for
the RAM tier, `STORAGE` for the durable tier) and withdraws it when the tier no longer can.

Events carry what vLLM's own `BlockStored` for the same blocks carries — vLLM's public block
hashes, parent hash, token ids, block size, LoRA and extra keys — and nothing else: kvci's keyed
page keys stay secret, and no tenant is named. Tenants that share a prefix share its public
hashes, so a hash is announced while at least one tenant's page of it is loadable (a router sees
where a prefix lives, not whose it is).

The tiers tell pages by their keyed keys (`TierListener`); a request's blocks are described
when it finishes, while vLLM's request is alive, and the description is kept while a tier holds
the page. Everything here is bounded, and none of it exists unless vLLM's KV events are enabled:
the token ids of at most ``MAX_HELD_TOKENS`` tokens of held pages are kept (a page past the bound
is withdrawn from the routers, as if its tier had dropped it), and of at most ``max_described``
pages waiting for their store.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvci_plugin.tiering.loadable import Tier
from kvci_plugin.tiering.types import PageKey

logger = logging.getLogger(__name__)

MEDIUM = {"ram": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
MAX_EVENTS = 65536  # queued between two steps; vLLM drains them every step
MAX_HELD_TOKENS = 1 << 22  # token ids kept for held pages: some 150 MiB of Python ints at most


@dataclass(frozen=True, slots=True)
class _Block:
    """What vLLM's own BlockStored says of one block of one KV cache group."""

    hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None  # as vLLM hashes them (tagged)
    lora_id: int | None
    lora_name: str | None
    group: int


class KVCIEvents:
    """Turns the tiers' page notices into vLLM KV events (a `TierListener`). Thread-safe: the
    control surface's promote and reset tell pages from its own thread."""

    def __init__(self, block_size: int, hash_block_size: int, max_described: int,
                 max_held_tokens: int = MAX_HELD_TOKENS) -> None:
        self._block_size = block_size
        self._hash_block_size = hash_block_size
        self._max_described = max_described
        self._max_held = max(1, max_held_tokens // block_size)
        self._lock = threading.Lock()
        # Blocks of finished requests whose store has not committed yet, oldest dropped first.
        self._described: OrderedDict[PageKey, _Block] = OrderedDict()
        # Pages some tier holds: their block, and the media that hold them; least recently
        # stored first.
        self._held: OrderedDict[PageKey, tuple[_Block, set[str]]] = OrderedDict()
        # Pages per announced (medium, group, public hash): tenants share public hashes.
        self._refs: Counter[tuple[str, int, BlockHash]] = Counter()
        self._events: deque[KVCacheEvent] = deque()
        self.dropped = 0  # events lost to the queue's bound

    def describe(self, request: Any, group_keys: Sequence[Sequence[PageKey]], n_blocks: int,
                 keys: Iterable[PageKey]) -> None:
        """Record vLLM's description of the request's blocks whose page ``keys`` it may store:
        block ``i`` of group ``g`` is ``group_keys[g][i]``."""
        wanted = set(keys)
        bs = self._block_size
        hashes = resolve_block_hashes(request.block_hashes, self._hash_block_size, bs)
        n = min(n_blocks, len(hashes))
        lora = request.lora_request
        tokens = request.all_token_ids
        blocks: list[tuple[PageKey, _Block]] = []
        for i in range(n):
            extra: tuple[Any, ...] | None = None
            described = False
            for g, group in enumerate(group_keys):
                key = group[i]
                if key not in wanted:
                    continue
                if not described:  # kvci keys no multimodal request: no feature index moves
                    extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
                    described = True
                blocks.append((key, _Block(
                    hash=hashes[i], parent=hashes[i - 1] if i else None,
                    token_ids=tuple(tokens[i * bs:(i + 1) * bs]), extra_keys=extra,
                    lora_id=lora.adapter_id if lora else None,
                    lora_name=lora.name if lora else None, group=g)))
        with self._lock:
            for key, block in blocks:
                if key not in self._held:
                    self._described[key] = block
                    self._described.move_to_end(key)
            while len(self._described) > self._max_described:
                self._described.popitem(last=False)

    # ---- TierListener ---------------------------------------------------------------------------

    def pages_stored(self, tier: Tier, keys: Sequence[PageKey]) -> None:
        medium = MEDIUM[tier]
        with self._lock:
            new: list[_Block] = []
            for key in keys:
                held = self._held.get(key)
                if held is None:
                    block = self._described.pop(key, None)
                    if block is None:
                        continue  # stored by a node or a run this one did not see describe it
                    held = self._held[key] = (block, set())
                self._held.move_to_end(key)
                block, media = held
                if medium in media:
                    continue
                media.add(medium)
                ref = (medium, block.group, block.hash)
                self._refs[ref] += 1
                if self._refs[ref] == 1:
                    new.append(block)
            for run in _runs(new):
                self._push(_stored(run, medium, self._block_size))
            while len(self._held) > self._max_held:  # withdrawn: its description is let go
                oldest, (_, media) = next(iter(self._held.items()))
                for held_medium in list(media):
                    self._remove([oldest], held_medium)

    def pages_removed(self, tier: Tier, keys: Sequence[PageKey]) -> None:
        with self._lock:
            self._remove(keys, MEDIUM[tier])

    def _remove(self, keys: Sequence[PageKey], medium: str) -> None:
        """Withdraw ``keys`` from ``medium`` (the caller holds the lock)."""
        gone: dict[int, list[BlockHash]] = {}
        for key in keys:
            held = self._held.get(key)
            if held is None or medium not in held[1]:
                continue
            block, media = held
            media.discard(medium)
            if not media:
                del self._held[key]
            ref = (medium, block.group, block.hash)
            self._refs[ref] -= 1
            if self._refs[ref] == 0:
                del self._refs[ref]
                gone.setdefault(block.group, []).append(block.hash)
        for group, hashes in gone.items():
            self._push(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes],
                medium=medium, group_idx=group))

    # ---- vLLM -----------------------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = list(self._events), deque()
            return events

    def _push(self, event: KVCacheEvent) -> None:
        if len(self._events) >= MAX_EVENTS:
            self._events.popleft()
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("kvci: KV events are not being taken; the oldest are dropped")
        self._events.append(event)


def _runs(blocks: list[_Block]) -> list[list[_Block]]:
    """Consecutive blocks of one group and LoRA, each the parent's child: one event each, as
    vLLM announces a request's newly cached blocks."""
    runs: list[list[_Block]] = []
    for block in blocks:
        for run in runs:
            last = run[-1]
            if (last.group == block.group and last.lora_name == block.lora_name
                    and block.parent == last.hash):
                run.append(block)
                break
        else:
            runs.append([block])
    return runs


def _stored(run: list[_Block], medium: str, block_size: int) -> BlockStored:
    first = run[0]
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(b.hash) for b in run],
        parent_block_hash=None if first.parent is None else maybe_convert_block_hash(first.parent),
        token_ids=[t for b in run for t in b.token_ids],
        block_size=block_size,
        lora_id=first.lora_id,
        medium=medium,
        lora_name=first.lora_name,
        extra_keys=to_event_extra_keys([b.extra_keys for b in run]),
        group_idx=first.group,
    )
