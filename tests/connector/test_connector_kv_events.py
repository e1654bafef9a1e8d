"""KV events for cache-aware routers, on a real engine with vLLM's own ZMQ publisher.

vLLM publishes its own GPU prefix cache's `BlockStored` (prefix caching is on) and kvci's tier
events on one stream; the subscriber here binds a loopback SUB socket (an endpoint with a host
makes vLLM's PUB connect to it). kvci's events for a block must say what vLLM's own say for it.

The tests share one engine and pass in any order: each uses prompts of its own, and looks only
at events about its prompts' blocks, from the point it starts.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from durable_support import session_token, setup_dirs
from engine import BLOCK_SIZE, generate_one, greedy, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

rng = random.Random(22)
RAM_PAGES = 16  # pages of 16 KiB (see test_connector_ram); a prompt below keeps 4 or 5


def _tokens(n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


@dataclass(frozen=True)
class Block:
    """One block as an event describes it."""

    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    extra_keys: Any
    group_idx: int | None


class Subscriber:
    """Collects every KV event batch vLLM publishes, with its raw bytes."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self.events: list[Any] = []
        self.payloads: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self.payloads.append(payload)
                self.events.extend(batch.events)

    def mark(self) -> int:
        with self._lock:
            return len(self.events)

    def since(self, mark: int) -> list[Any]:
        with self._lock:
            return self.events[mark:]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def sub():
    s = Subscriber()
    yield s
    s.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("events")


@pytest.fixture(scope="module")
def llm(tiny_model, sub, root):
    extra = setup_dirs(root)
    extra["ram_bytes"] = f"{RAM_PAGES * 16}KiB"
    llm = make_llm(tiny_model, extra, enable_prefix_caching=True, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint})
    yield llm
    shutdown(llm)


def _blocks(events: list[Any], kind: str, medium: str) -> dict[Any, Block]:
    """Block hash -> how the events of this kind and medium describe it."""
    out: dict[Any, Block] = {}
    for e in events:
        if type(e).__name__ != kind or e.medium != medium:
            continue
        for i, h in enumerate(e.block_hashes):
            if kind == "BlockRemoved":
                out[h] = None  # type: ignore[assignment]
                continue
            out[h] = Block(
                parent=e.parent_block_hash if i == 0 else e.block_hashes[i - 1],
                token_ids=tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size]),
                block_size=e.block_size, lora_name=e.lora_name,
                extra_keys=None if e.extra_keys is None else e.extra_keys[i],
                group_idx=e.group_idx)
    return out


def _of(blocks: dict[Any, Block], tokens: list[int]) -> dict[Any, Block]:
    """The blocks that are full blocks of ``tokens``."""
    full = {tuple(tokens[i:i + BLOCK_SIZE]) for i in range(0, len(tokens) - BLOCK_SIZE + 1,
                                                             BLOCK_SIZE)}
    return {h: b for h, b in blocks.items() if b.token_ids in full}


def _wait(llm, sub: Subscriber, mark: int, done: Callable[[list[Any]], bool]) -> list[Any]:
    """Step the engine (a one-token request) until the events since ``mark`` satisfy ``done``."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        events = sub.since(mark)
        if done(events):
            return events
        generate_one(llm, [5, 6, 7], greedy(1))
        time.sleep(0.05)
    pytest.fail("the expected KV events did not arrive")


def _keep(llm, tokens: list[int], **kvci: Any) -> tuple[dict[str, Any], list[int]]:
    out = generate_one(llm, tokens, kvci_params(checkpoint="now", **kvci))
    reply = out.kv_transfer_params["kvci"]
    assert reply["tier"] == "ram", reply
    return reply, tokens + list(out.outputs[0].token_ids)


def _kept_blocks(all_tokens: list[int]) -> int:
    """A finished request keeps its computed full blocks (the last sampled token has no KV)."""
    return (len(all_tokens) - 1) // BLOCK_SIZE


def test_stored_events_carry_vllms_own_hashes(llm, sub):
    mark = sub.mark()
    tokens = _tokens(5 * BLOCK_SIZE + 7)
    _, seen = _keep(llm, tokens, tenant="hashes")
    n = _kept_blocks(seen)
    events = _wait(llm, sub, mark,
                   lambda ev: len(_of(_blocks(ev, "BlockStored", "CPU"), seen)) >= n)
    kvci = _of(_blocks(events, "BlockStored", "CPU"), seen)
    gpu = _of(_blocks(events, "BlockStored", "GPU"), seen)
    assert len(kvci) == n and n >= 5
    # Every block kvci announces is one vLLM announced, said the same way, chained from the root.
    for h, block in kvci.items():
        assert gpu[h] == block
    roots = [h for h, b in kvci.items() if b.parent is None]
    assert len(roots) == 1 and kvci[roots[0]].token_ids == tuple(tokens[:BLOCK_SIZE])


def test_persist_announces_storage_after_cpu(llm, sub, root):
    mark = sub.mark()
    tokens = _tokens(4 * BLOCK_SIZE + 9)
    reply, seen = _keep(llm, tokens, tenant="acme", session_token=session_token(root),
                        persist=True, source_ids=["doc:handbook"])
    assert reply["persist"]["status"] in ("persisting", "persisted")
    n = _kept_blocks(seen)
    events = _wait(llm, sub, mark,
                   lambda ev: len(_of(_blocks(ev, "BlockStored", "STORAGE"), seen)) >= n)
    cpu = _of(_blocks(events, "BlockStored", "CPU"), seen)
    storage = _of(_blocks(events, "BlockStored", "STORAGE"), seen)
    assert set(cpu) == set(storage) and len(storage) == n
    assert all(cpu[h] == storage[h] for h in cpu)
    # CPU first: the durable copy is written from the RAM tier's pages.
    kinds = [
        (type(e).__name__, e.medium)
        for e in events
        if set(getattr(e, "block_hashes", ())) & set(cpu)
    ]
    assert kinds.index(("BlockStored", "CPU")) < kinds.index(("BlockStored", "STORAGE"))


def test_eviction_removes_from_cpu(llm, sub):
    mark = sub.mark()
    _, victim = _keep(llm, _tokens(4 * BLOCK_SIZE + 5), tenant="evicted")
    events = _wait(llm, sub, mark, lambda ev: len(_of(_blocks(ev, "BlockStored", "CPU"), victim))
                   >= _kept_blocks(victim))
    hashes = set(_of(_blocks(events, "BlockStored", "CPU"), victim))
    for _ in range(RAM_PAGES // 4 + 1):  # more distinct pages than the RAM tier holds
        _keep(llm, _tokens(4 * BLOCK_SIZE + 5), tenant="flood")
    events = _wait(llm, sub, mark, lambda ev: hashes <= set(_blocks(ev, "BlockRemoved", "CPU")))
    assert hashes <= set(_blocks(events, "BlockRemoved", "CPU"))
    assert not hashes & set(_blocks(events, "BlockRemoved", "STORAGE"))  # it was never durable


def test_reset_removes_every_tier(llm, sub, root):
    mark = sub.mark()
    _, ram_only = _keep(llm, _tokens(4 * BLOCK_SIZE + 3), tenant="reset")
    _, durable = _keep(llm, _tokens(4 * BLOCK_SIZE + 11), tenant="acme",
                       session_token=session_token(root), persist=True, source_ids=["doc:handbook"])
    events = _wait(
        llm,
        sub,
        mark,
        lambda ev: (
            len(_of(_blocks(ev, "BlockStored", "STORAGE"), durable)) >= _kept_blocks(durable)
        ),
    )
    in_ram = set(_of(_blocks(events, "BlockStored", "CPU"), ram_only))
    on_disk = set(_of(_blocks(events, "BlockStored", "STORAGE"), durable))
    assert in_ram and on_disk
    after = sub.mark()
    assert llm.reset_prefix_cache(reset_connector=True)
    events = _wait(llm, sub, after, lambda ev: in_ram <= set(_blocks(ev, "BlockRemoved", "CPU"))
                   and on_disk <= set(_blocks(ev, "BlockRemoved", "STORAGE")))
    assert in_ram <= set(_blocks(events, "BlockRemoved", "CPU"))


def test_second_tenant_is_named_nowhere(llm, sub):
    mark = sub.mark()
    payloads = len(sub.payloads)
    tenant = "globex-secret-tenant"
    tokens = _tokens(4 * BLOCK_SIZE + 6)
    _, seen = _keep(llm, tokens, tenant="first-tenant")
    n = _kept_blocks(seen)
    events = _wait(llm, sub, mark,
                   lambda ev: len(_of(_blocks(ev, "BlockStored", "CPU"), seen)) >= n)
    announced = set(_of(_blocks(events, "BlockStored", "CPU"), seen))
    # The second tenant keeps the same prompt: its own pages (keys are per tenant), the same
    # public hashes, so a router learns nothing that tells the tenants apart; then a prompt of
    # its own, whose store commits after the first one's (stores commit in step order).
    second = sub.mark()
    reply, seen_again = _keep(llm, tokens, tenant=tenant, session_id="its-session")
    assert seen_again == seen and reply["checkpoint_id"]
    _, own = _keep(llm, _tokens(4 * BLOCK_SIZE + 2), tenant=tenant, session_id="its-session")
    events = _wait(llm, sub, second, lambda ev: len(_of(_blocks(ev, "BlockStored", "CPU"), own))
                   >= _kept_blocks(own))
    assert not set(_of(_blocks(events, "BlockStored", "CPU"), seen)) - announced
    with sub._lock:
        raw = b"".join(sub.payloads[payloads:])
    assert raw and tenant.encode() not in raw and b"its-session" not in raw
    assert b"first-tenant" not in raw
