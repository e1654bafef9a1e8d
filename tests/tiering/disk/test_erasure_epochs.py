"""Erasure epochs across nodes sharing a real PostgreSQL catalog (and a shared blob folder): KV
that node B computed before node A's forget is never recorded, however late B persists it; B
erases the tenant from its own RAM tier by itself, shortly after; and KV B computes afterwards is
kept and persisted as any other."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_support import NS, SLOT, key_of, open_node, page_of

from kvci_plugin.governance.decision import EligibilityDecision, PersistenceDerivation
from kvci_plugin.tiering.blobs.factory import open_blob_root
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.erasures import ERASURE_SYNC_S
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey


class Permits:
    """Every persist is permitted: the gate is not what these tests are about."""

    name = "permits"

    def evaluate(self, request: Any) -> EligibilityDecision:
        return EligibilityDecision(
            permitted=True, gate=self.name, checkpoint_id=request.checkpoint_id,
            trigger=request.trigger, failed_check=None, reason="permitted",
            derivation=PersistenceDerivation(), evaluated_at=time.time())


class Workers:
    """The node's workers: RAM copies land at once; blob writes are queued until ``write``."""

    def __init__(self) -> None:
        self.persists: list[tuple[str, str, list[PageKey]]] = []

    def store(self, reservation: Any, source: Any) -> bool:
        return True

    def persist(self, checkpoint_id: str, tenant: str, keys: Any, slots: Any) -> bool:
        self.persists.append((checkpoint_id, tenant, list(keys)))
        return False


class Node:
    def __init__(self, shared: Path, catalog_url: str) -> None:
        self.disk = open_node("folder", str(shared), catalog_url)
        self.workers = Workers()
        self.manager = TieredCheckpointManager(
            index=RAMIndex(16, SLOT, 16), mover=self.workers, disk=self.disk, gate=Permits())
        self.blobs = open_blob_root(None, shared).store(NS)

    def keep(self, tenant: str, keys: list[PageKey], epoch: int | None = None) -> Any:
        return self.manager.checkpoint_now(tenant=tenant, keys=keys, trigger="user",
                                           recommendation=None, source=None,
                                           erasure_epoch=epoch)

    def write_blobs(self) -> list[Any]:
        """The workers write the queued blobs and report."""
        jobs, self.workers.persists = self.workers.persists, []
        outcomes = []
        for cid, tenant, keys in jobs:
            self.blobs.write_many(keys, tenant, torch.stack([page_of(k) for k in keys]))
            outcomes.append(self.manager.on_persisted(cid, ok=True))
        return outcomes

    def close(self) -> None:
        self.manager.close()
        self.disk.close()


@pytest.fixture
def nodes(tmp_path: Path, pg_catalog_url: str):
    a, b = Node(tmp_path / "shared", pg_catalog_url), Node(tmp_path / "shared", pg_catalog_url)
    yield a, b
    a.close()
    b.close()


def _until(predicate: Any, bound_s: float) -> bool:
    end = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_kv_computed_on_another_node_before_a_forget_is_never_recorded(nodes) -> None:
    a, b = nodes
    keys = [key_of(i) for i in range(3)]
    kept = b.keep("alice", keys)  # B computed alice's KV (stamped with the epoch it knew)
    assert kept.checkpoint_id is not None
    a.manager.forget("alice")  # on node A; B is not told
    late = b.manager.promote(kept.checkpoint_id, tenant="alice", trigger="user",
                             session_token=None)  # leased after the forget
    assert late.status == "failed" and "forgotten" in late.reason, late
    assert b.workers.persists == []  # refused before any blob was written
    assert b.disk.longest_prefix(keys, "alice") == 0 == a.disk.longest_prefix(keys, "alice")


def test_another_node_erases_a_forgotten_tenant_from_its_ram_by_itself(nodes) -> None:
    a, b = nodes
    alice, bob = [key_of(i) for i in range(3)], [key_of(10 + i) for i in range(3)]
    assert b.keep("alice", alice).checkpoint_id is not None
    assert b.keep("bob", bob).checkpoint_id is not None
    computed_at = b.manager.erasure_epoch  # a request of alice's looked up on B now...
    a.manager.forget("alice")
    # ...B learns of the forget off its engine's threads and erases alice from its RAM.
    assert _until(lambda: b.manager.index.longest_prefix(alice, "alice") == 0,
                  3 * ERASURE_SYNC_S + 2)
    assert b.manager.index.longest_prefix(bob, "bob") == 3  # nobody else's
    assert b.manager.erasure_epoch > computed_at
    # The request computed before the forget finishes now: its KV is not kept.
    refused = b.keep("alice", alice, epoch=computed_at)
    assert refused.checkpoint_id is None and "forgotten" in refused.reason
    # KV computed afterwards is kept and persisted, and served to the other node.
    again = b.keep("alice", alice, epoch=b.manager.erasure_epoch)
    assert again.checkpoint_id is not None
    started = b.manager.promote(again.checkpoint_id, tenant="alice", trigger="user",
                                session_token=None)
    assert started.status == "persisting", started
    (written,) = b.write_blobs()
    assert written.status == "persisted", written.reason
    assert a.disk.longest_prefix(alice, "alice") == 3


def test_erasure_epochs_are_given_in_commit_order_and_read_by_every_node(
        tmp_path: Path, pg_catalog_url: str) -> None:
    one = CheckpointCatalog(url=pg_catalog_url)
    two = CheckpointCatalog(url=pg_catalog_url)
    assert one.erasure_epoch() == 0
    _, first = one.forget_tenant("alice")
    _, second = two.forget_tenant("bob")
    _, third = one.forget_tenant("alice")
    assert (first, second, third) == (1, 2, 3)
    assert two.erasure_epoch() == 3
    assert two.forgotten_since(1) == {"bob": 2, "alice": 3}
    assert one.erased_at("alice") == 3 and one.erased_at("carol") == 0
    one.close()
    two.close()


def test_a_catalog_from_before_epochs_migrates_with_its_forgotten_tenants_at_epoch_0(
        tmp_path: Path) -> None:
    import sqlite3

    from kvci_plugin.tiering.disk.schema import MIGRATIONS

    path = tmp_path / "catalog.sqlite3"
    with sqlite3.connect(path) as db:  # schema version 5: forgets without epochs
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for statements in MIGRATIONS[:5]:
            for statement in statements:
                db.execute(statement)
        db.execute("INSERT INTO forgotten_tenants (tenant, forgotten_at) VALUES ('old', 1.0)")
        db.execute("INSERT INTO schema_version (version) VALUES (5)")
    catalog = CheckpointCatalog(path)
    assert catalog.schema_version() == len(MIGRATIONS)
    assert catalog.erased_at("old") == 0 and catalog.erasure_epoch() == 0
    assert catalog.forget_tenant("new")[1] == 1
    assert catalog.forgotten_since(0) == {"new": 1}
    catalog.close()


def test_a_failing_read_of_other_nodes_forgets_is_handed_on_and_degrades_the_tier(
        nodes, monkeypatch) -> None:
    """The erasure watch may be the first to meet a catalog that went down (on its own thread,
    no engine step asked): the failure reaches the scheduler's fault count all the same."""
    import psycopg

    from kvci_plugin.tiering.health import fault_kind

    _, b = nodes
    seen: list[BaseException] = []
    b.manager.watch_faults(seen.append)

    def down(since: int) -> dict[str, int]:
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(b.disk._catalog, "forgotten_since", down)
    assert _until(lambda: seen, 3 * ERASURE_SYNC_S + 2)
    assert fault_kind(seen[0]) == "unavailable"
    # It began an incident: the engine's lookups skip the tier until a probe answers.
    assert b.disk.health.report().incidents >= 1
