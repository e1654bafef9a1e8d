"""The scheduler's stats, taken every engine step, report what the tier policy and the
retentions did exactly once, and cost a step that changed nothing no report at all (no engine:
the real scheduler side, its real RAM index and retentions)."""

from __future__ import annotations

import hashlib

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"step-stats").digest()


def scheduler() -> KVCIScheduler:
    return KVCIScheduler(config=KVCIConfig(ram_bytes=2 * SLOT, ram_policy="lru"), block_size=BS,
                         slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
                         tenants=TenantResolver(None), disk=None)


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def keep(s: KVCIScheduler, cid: str, *keys: bytes) -> None:
    index = s.manager.index
    index.reserve(cid, "t", list(keys))
    index.commit(cid)


def test_a_step_that_changed_nothing_reports_nothing() -> None:
    s = scheduler()
    assert s.take_stats() is not None  # the bar's gauge, once
    assert s.take_stats() is None
    s.manager.index.observe_lookup([key(1)])  # a lookup alone moves no count
    assert s.take_stats() is None


def test_unread_evictions_are_reported_once_when_they_happen() -> None:
    s = scheduler()
    s.take_stats()
    keep(s, "a", key(1), key(2))
    assert s.take_stats() is None  # kept, nothing evicted yet
    keep(s, "b", key(3), key(4))  # the tier holds two pages: "a" leaves, never read
    assert s.take_stats().reduce()["ram_evicted_unread"] == 1
    assert s.take_stats() is None
    keep(s, "c", key(5), key(6))  # "b" leaves unread too
    assert s.take_stats().reduce()["ram_evicted_unread"] == 1


def test_retained_bytes_and_released_retentions_are_reported_when_they_move() -> None:
    s = scheduler()
    s.take_stats()
    keep(s, "a", key(1))
    with s.manager.lock:
        s.manager.retentions.grant("a", "t", [key(1)], 60.0, "sess")
    assert s.take_stats().reduce()["ram_retained_bytes"] == SLOT
    assert s.take_stats() is None
    s.manager.release_retentions("t", "sess")
    totals = s.take_stats().reduce()
    assert totals["ram_retained_bytes"] == 0
    assert totals["retentions_released"] == 1
    assert s.take_stats() is None
