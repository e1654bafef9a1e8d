"""The tier manager tells a listener which pages each tier can load, as they come and go: real
RAM and disk tiers and gate (the worlds of test_manager), a listener that records."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest
from test_manager import (  # noqa: F401 (fixtures)
    QueuedMover,
    World,
    issuer_key,
    keys_for,
    make,
    pages_for,
)

from kvci_plugin.tiering.loadable import Tier
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.types import PageKey


class Recorder:
    def __init__(self) -> None:
        self.told: list[tuple[str, Tier, tuple[PageKey, ...]]] = []

    def pages_stored(self, tier: Tier, keys: Sequence[PageKey]) -> None:
        self.told.append(("stored", tier, tuple(keys)))

    def pages_removed(self, tier: Tier, keys: Sequence[PageKey]) -> None:
        self.told.append(("removed", tier, tuple(keys)))

    def take(self) -> list[tuple[str, Tier, tuple[PageKey, ...]]]:
        told, self.told = self.told, []
        return told


@pytest.fixture
def watched(make: Callable[..., World]) -> tuple[World, Recorder]:  # noqa: F811 (the fixture)
    world = make(queued=True)
    recorder = Recorder()
    world.manager.watch(recorder)
    return world, recorder


def test_pages_are_stored_when_their_copy_commits_and_once(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    cid, keys, _ = world.checkpoint("a", n=3)
    assert rec.take() == []  # reserved, not yet copied: not loadable
    mover.finish_store(world.manager, cid)
    assert rec.take() == [("stored", "ram", tuple(keys))]
    # A checkpoint sharing the pages tells nothing: they were loadable already.
    again = world.manager.checkpoint_now(tenant="acme", keys=keys, trigger="user",
                                         recommendation=None, source=None)
    assert again.new_pages == 0 and rec.take() == []


def test_a_failed_copy_tells_nothing_and_an_eviction_tells_removed(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    failed, _, _ = world.checkpoint("failed", n=4)
    mover.finish_store(world.manager, failed, ok=False)
    assert rec.take() == []
    first, first_keys, _ = world.checkpoint("first", n=8)
    mover.finish_store(world.manager, first)
    rec.take()
    # 16 slots: 10 more pages take two of the first checkpoint's (least recently used): its tail.
    second, second_keys, outcome = world.checkpoint("second", n=10)
    assert outcome.trimmed == (first,) and outcome.evicted == ()
    assert rec.take() == [("removed", "ram", tuple(first_keys[6:]))]
    mover.finish_store(world.manager, second)
    assert rec.take() == [("stored", "ram", tuple(second_keys))]


def test_durable_pages_are_stored_on_their_row_and_a_discarded_one_removed(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    cid, keys, _ = world.checkpoint("durable", n=3, persist=True, session_token=world.session())
    mover.finish_store(world.manager, cid)
    assert rec.take() == [("stored", "ram", tuple(keys))]
    mover.finish_persists(world.manager)
    assert rec.take() == [("stored", "disk", tuple(keys))]
    assert world.disk is not None
    world.disk.discard(keys[1:2])  # a blob that failed its checksum
    # Only that page stops being loadable: the pages before it still load (a prefix hit).
    assert rec.take() == [("removed", "disk", (keys[1],))]
    assert world.disk.longest_prefix(keys, "acme") == 1


def test_a_reset_tells_every_tier_removed(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    durable, durable_keys, _ = world.checkpoint("d", n=2, persist=True,
                                                session_token=world.session())
    mover.finish_store(world.manager, durable)
    mover.finish_persists(world.manager)
    ram_only, ram_keys, _ = world.checkpoint("r", n=2)
    mover.finish_store(world.manager, ram_only)
    rec.take()
    world.manager.reset()
    told = rec.take()
    removed = {tier: set() for tier in ("ram", "disk")}
    for kind, tier, keys in told:
        assert kind == "removed"
        removed[tier].update(keys)
    assert removed == {"ram": set(durable_keys) | set(ram_keys), "disk": set(durable_keys)}
    # The next generation starts empty: the same keys are told again once kept again.
    again, _, _ = world.checkpoint("r", n=2)
    mover.finish_store(world.manager, again)
    assert rec.take() == [("stored", "ram", tuple(keys_for("acme/r", 2)))]


def test_durable_pages_are_removed_once_their_retention_passes(make: Callable[..., World]) -> None:  # noqa: F811
    world = make(queued=True)
    now = [time.time()]
    manager = TieredCheckpointManager(index=world.ram.index, mover=world.mover, disk=world.disk,
                                      disk_region="eu", gate=world.gate, clock=lambda: now[0])
    world.manager = manager
    rec = Recorder()
    manager.watch(rec)
    mover: QueuedMover = world.mover
    cid, keys, _ = world.checkpoint("thirty-days", n=2, persist=True, session_token=world.session())
    mover.finish_store(manager, cid)
    mover.finish_persists(manager)
    assert rec.take() == [("stored", "ram", tuple(keys)), ("stored", "disk", tuple(keys))]
    manager.collect_expired()
    assert rec.take() == []
    now[0] += 31 * 86_400.0  # the handbook's labels allow 30 days
    manager.collect_expired()
    assert rec.take() == [("removed", "disk", tuple(keys))]
    assert world.disk is not None and world.disk.longest_prefix(keys, "acme") == 0


def test_a_forget_tells_its_tenants_ram_pages_removed_and_no_other_tenants(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    kept, kept_keys, _ = world.checkpoint("kept", n=3)
    mover.finish_store(world.manager, kept)
    # Shares the first two pages and adds two of its own; still being copied when forgotten.
    grown = keys_for("acme/kept", 3)[:2] + keys_for("acme/more", 2)
    pending = world.manager.checkpoint_now(tenant="acme", keys=grown, trigger="user",
                                           recommendation=None, source=pages_for(grown))
    other, other_keys, _ = world.checkpoint("other", n=2, tenant="other-co")
    mover.finish_store(world.manager, other)
    rec.take()
    assert world.manager.forget_ram("acme").ram_checkpoints == 2
    (told,) = rec.take()
    assert told[:2] == ("removed", "ram")
    # The pending checkpoint's own two pages were never loadable: nothing to tell of them.
    assert sorted(told[2]) == sorted(kept_keys)
    assert mover.finish_store(world.manager, pending.checkpoint_id) is None
    assert rec.take() == []
    assert world.ram.index.longest_prefix(other_keys, "other-co") == 2


def test_a_page_shared_with_a_store_under_way_is_told_by_the_store_that_copies_it(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    first, first_keys, _ = world.checkpoint("first", n=3)
    grown = first_keys + keys_for("acme/grown", 1)
    second = world.manager.checkpoint_now(tenant="acme", keys=grown, trigger="user",
                                          recommendation=None, source=pages_for(grown))
    assert second.new_pages == 1  # the first three are the first store's to copy in
    mover.finish_store(world.manager, second.checkpoint_id)
    assert rec.take() == [("stored", "ram", tuple(grown[3:]))]
    mover.finish_store(world.manager, first)
    assert rec.take() == [("stored", "ram", tuple(first_keys))]


def test_a_forget_tells_pages_a_load_still_pins_removed_at_once(watched) -> None:
    world, rec = watched
    mover: QueuedMover = world.mover
    cid, keys, _ = world.checkpoint("pinned", n=3)
    mover.finish_store(world.manager, cid)
    rec.take()
    world.ram.index.pin(keys[:2], "acme")  # a load under way
    world.manager.forget_ram("acme")
    (told,) = rec.take()
    assert told[:2] == ("removed", "ram") and sorted(told[2]) == sorted(keys)
    assert world.ram.index.longest_prefix(keys, "acme") == 0
    world.ram.index.unpin(keys[:2])  # freed now: nothing more to tell
    assert rec.take() == [] and world.ram.index.stats().pages == 0
