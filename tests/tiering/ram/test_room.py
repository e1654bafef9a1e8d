"""Fair shares of the RAM tier (tiering.ram.room): under pressure, room comes first from the pools
past their share — explicit checkpoints included — and a pool past its share never takes a pool's
within its own; declared tenants share one pool. Alone, a pool has the whole tier, and the
policy's order is all there is."""

from __future__ import annotations

import hashlib

import pytest

from kvci_plugin.policy import LRUPolicy, Offer, ValuePolicy
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.pages import LAST_PLAN
from kvci_plugin.tiering.ram.room import DECLARED_POOL


def key(name: str, i: int = 0) -> bytes:
    return hashlib.sha256(f"{name}/{i}".encode()).digest()[:16]


def keep(
    index: RAMIndex,
    cid: str,
    tenant: str,
    pages: int = 1,
    *,
    explicit: bool = False,
    pool: str | None = None,
) -> None:
    keys = [key(cid, i) for i in range(pages)]
    index.reserve(cid, tenant, keys, offer=Offer(anchor=keys[-1], explicit=explicit), pool=pool)
    index.commit(cid)


def held(index: RAMIndex, tenant: str) -> int:
    return index.stats().tenant_bytes.get(tenant, 0)


@pytest.mark.parametrize("policy", [ValuePolicy, LRUPolicy])
def test_a_flood_of_explicit_checkpoints_does_not_lock_another_tenant_out(policy) -> None:
    """The review's reproduction: eight one-block explicit checkpoints of mallory fill the tier;
    acme's explicit checkpoint is kept, taking mallory's (past its share), not refused."""
    index = RAMIndex(8, 1, 64, policy=policy())
    for i in range(8):
        keep(index, f"m{i}", "mallory", explicit=True)
    keep(index, "a0", "acme", explicit=True)
    assert held(index, "acme") == 1 and held(index, "mallory") == 7
    # And a system checkpoint of acme's (not explicit) too, up to acme's share.
    for i in range(1, 4):
        keep(index, f"a{i}", "acme")
    assert held(index, "acme") == 4 and held(index, "mallory") == 4


def test_a_tenant_past_its_share_takes_its_own_first() -> None:
    index = RAMIndex(8, 1, 64, policy=LRUPolicy())
    for i in range(3):
        keep(index, f"a{i}", "acme")  # within its share of 4
    for i in range(20):  # mallory floods: the free pages, then its own oldest
        keep(index, f"m{i}", "mallory")
    assert held(index, "acme") == 3 and held(index, "mallory") == 5
    assert {e.checkpoint_id for e in index.entries("acme")} == {"a0", "a1", "a2"}
    keep(index, "huge", "mallory", pages=6)  # its own five go first; one more page from acme
    assert held(index, "mallory") == 6 and held(index, "acme") == 2


def test_free_pages_are_anyones_while_there_is_no_pressure() -> None:
    index = RAMIndex(8, 1, 64, policy=LRUPolicy())
    keep(index, "a0", "acme")
    keep(index, "m0", "mallory", pages=7)  # past its share of 4, but nothing had to go
    assert held(index, "mallory") == 7
    keep(index, "a1", "acme", pages=3)  # acme's share back, from mallory's excess
    # Only the pages acme needed left: m0 keeps its head, back within mallory's share.
    assert held(index, "acme") == 4 and held(index, "mallory") == 4


def test_declared_tenants_share_one_pool_so_renaming_buys_nothing() -> None:
    index = RAMIndex(8, 1, 64, policy=LRUPolicy())
    for i in range(3):
        keep(index, f"a{i}", "acme")  # verified: a pool of its own
    for i in range(20):  # a client renaming its declared tenant at every request
        keep(index, f"m{i}", f"alias{i}", pool=DECLARED_POOL)
    assert held(index, "acme") == 3
    assert sum(index.stats().tenant_bytes.values()) - held(index, "acme") == 5
    assert index.fair_share_bytes("acme") == 4  # two pools, however many names


def test_alone_a_pool_has_the_whole_tier_and_the_policy_decides() -> None:
    index = RAMIndex(4, 1, 64, policy=LRUPolicy())
    for i in range(6):
        keep(index, f"a{i}", "acme")
    assert [e.checkpoint_id for e in index.entries()] == ["a2", "a3", "a4", "a5"]
    assert index.fair_share_bytes("acme") == 4



@pytest.mark.parametrize("come_round", [False, True])
def test_room_is_planned_alike_when_the_plan_numbers_come_round(come_round) -> None:
    """The planner's per-page scratch is stamped with each plan's number and never reset; after
    the last number it is cleared and numbering starts again, so what the plan that had the
    number before counted is not read as the new plan's."""
    index = RAMIndex(num_slots=4, slot_bytes=1, max_entries=100)
    for cid in ("a", "b"):
        keep(index, cid, "t", pages=2)
    keep(index, "c", "t", pages=2)  # the first plan evicts a; c takes a's slots
    if come_round:
        index._pages._plans = LAST_PLAN  # the next plan is number 1 again
    b_keys = [key("b", 0), key("b", 1)]
    index.pin(b_keys, "t")  # a load of b: b is the most recently used
    index.unpin(b_keys)
    res = index.reserve("d", "t", [key("d", 0), key("d", 1)])  # b was just used: c leaves
    assert [e.checkpoint_id for e in res.evicted] == ["c"]
    assert [e.checkpoint_id for e in index.entries()] == ["b", "d"]
