"""The KV events' memory is bounded: the token ids of held pages are kept for at most a budget of
tokens; a page past it is withdrawn from the routers (a BlockRemoved) as if its tier had dropped
it, the least recently stored first. Real vLLM requests and block hashes, no engine."""

from __future__ import annotations

import hashlib

from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvci_plugin.connector.events import KVCIEvents

BS = 32


def _request(req_id: str, first: int, blocks: int) -> Request:
    init_none_hash(sha256)
    return Request(req_id, list(range(first, first + blocks * BS)), SamplingParams(max_tokens=1),
                   None, block_hasher=get_request_block_hasher(BS, sha256))


def _keys(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}{i}".encode()).digest()[:16] for i in range(n)]


def test_held_pages_past_the_token_budget_are_withdrawn_oldest_first() -> None:
    events = KVCIEvents(BS, BS, max_described=64, max_held_tokens=4 * BS)
    first, second = _keys("a", 3), _keys("b", 3)
    events.describe(_request("a", 1000, 3), [first], 3, first)
    events.pages_stored("ram", first)
    events.describe(_request("b", 5000, 3), [second], 3, second)
    events.pages_stored("ram", second)
    out = events.take_events()
    stored = [e for e in out if isinstance(e, BlockStored)]
    removed = [e for e in out if isinstance(e, BlockRemoved)]
    assert [len(e.block_hashes) for e in stored] == [3, 3]
    # Six pages held, room for four: the first request's first two blocks are withdrawn.
    assert [h for e in removed for h in e.block_hashes] == stored[0].block_hashes[:2]
    # A withdrawn page that its tier drops later says nothing more.
    events.pages_removed("ram", first[:2])
    assert events.take_events() == []
    events.pages_removed("ram", first[2:])
    (last,) = events.take_events()
    assert isinstance(last, BlockRemoved) and last.block_hashes == stored[0].block_hashes[2:]
