"""Retentions on a real RAM index: exempt from eviction while they last, bounded by the tenant
quota, ended by their TTL (a clock the test moves), their session's next request, or a reset."""

from __future__ import annotations

import hashlib

import pytest

from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.retention import RetentionRefused, Retentions
from kvci_plugin.tiering.types import DoesNotFitError, PageKey

SLOT = 512


def keys(name: str, n: int) -> list[PageKey]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest()[:16] for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keep(index: RAMIndex, cid: str, ks: list[PageKey], tenant: str = "acme") -> None:
    index.reserve(cid, tenant, ks)
    index.commit(cid)


@pytest.fixture
def tier() -> tuple[RAMIndex, Retentions, Clock]:
    index = RAMIndex(8, SLOT, max_entries=16, tenant_quota_bytes=6 * SLOT)
    clock = Clock()
    return index, Retentions(index, 6 * SLOT, clock=clock), clock


def test_a_retained_checkpoint_is_not_evicted_until_its_ttl(tier) -> None:
    index, retentions, clock = tier
    kept = keys("kept", 4)
    keep(index, "kept", kept)
    retentions.grant("kept", "acme", kept, 10.0, None)
    retentions.committed()
    # 8 slots, 4 retained: 5 more pages of the tenant do not fit (another tenant asking for
    # more than its fair share would not displace acme's within its share, retained or not).
    with pytest.raises(DoesNotFitError):
        index.reserve("big", "acme", keys("big", 5))
    clock.now += 9.9
    retentions.expire()
    assert retentions.stats().retained_bytes == 4 * SLOT
    clock.now += 0.2
    retentions.expire()
    stats = retentions.stats()
    assert (stats.retained_bytes, stats.expired, stats.retentions) == (0, 1, 0)
    assert "kept" in index.reserve("big", "acme", keys("big", 5)).evicted[0].checkpoint_id


def test_the_sessions_next_request_ends_its_retentions_only(tier) -> None:
    index, retentions, _ = tier
    for name, session in (("a", "s1"), ("b", "s2")):
        keep(index, name, keys(name, 2))
        retentions.grant(name, "acme", keys(name, 2), 60.0, session)
    retentions.committed()
    retentions.release_session("acme", "s1")
    retentions.release_session("globex", "s2")  # another tenant's session of the same name
    stats = retentions.stats()
    assert (stats.retentions, stats.released, stats.retained_bytes) == (1, 1, 2 * SLOT)
    assert index.stats().pinned_pages == 2


def test_retained_bytes_stay_within_the_tenant_quota(tier) -> None:
    index, retentions, _ = tier
    keep(index, "a", keys("a", 4))
    retentions.grant("a", "acme", keys("a", 4), 60.0, None)
    with pytest.raises(RetentionRefused, match="over its quota of 3072 bytes"):
        retentions.check("acme", keys("b", 3))
    retentions.check("acme", keys("a", 4) + keys("b", 2))  # shared pages count once
    retentions.check("globex", keys("c", 6))  # the quota is per tenant


def test_a_retention_of_a_pending_store_pins_once_committed_and_a_failed_one_ends(tier) -> None:
    index, retentions, _ = tier
    index.reserve("p", "acme", keys("p", 2))
    retentions.grant("p", "acme", keys("p", 2), 60.0, None)
    retentions.committed()  # its pages are still being copied: nothing to pin yet
    assert index.stats().pinned_pages == 0
    index.commit("p")
    retentions.committed()
    assert index.stats().pinned_pages == 2
    index.reserve("f", "acme", keys("f", 2))
    retentions.grant("f", "acme", keys("f", 2), 60.0, None)
    index.abort("f")
    retentions.dropped("f")
    assert retentions.stats().retained_bytes == 2 * SLOT
    index.clear()
    retentions.clear()
    assert retentions.stats().retentions == 0


def test_without_a_tenant_quota_a_pool_retains_at_most_its_fair_share() -> None:
    """The review's reproduction retained every slot of the tier for one tenant: with no
    tenant_quota_bytes, a tenant's retentions are bounded by its fair share instead."""
    index = RAMIndex(8, SLOT, max_entries=16)
    retentions = Retentions(index, None)
    keep(index, "a", keys("a", 1), tenant="acme")
    keep(index, "m", keys("m", 6), tenant="mallory")  # free pages: kept
    with pytest.raises(RetentionRefused, match="fair share"):
        retentions.grant("m", "mallory", keys("m", 6), 60.0, None)  # 6 of 8: share is 4
    retentions.grant("m", "mallory", keys("m", 6)[:4], 60.0, None)
    assert retentions.stats().tenant_retained_bytes == {"mallory": 4 * SLOT}
