"""DiskAttach: a disk tier whose dependency did not answer at start is built again in the
background (the tier health's probe) until it is, then handed over once; the manager attaches it
between steps and, meanwhile, reports persists failed for an unavailable tier, not refused."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path

from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.tier import KVCheckpointStore

NS = hashlib.sha256(b"attach").digest()


class Flaky:
    """Builds a real SQLite disk tier, after failing ``failures`` times as a full disk would."""

    def __init__(self, root: Path, failures: int) -> None:
        self.root, self.failures, self.calls = root, failures, 0

    def __call__(self) -> KVCheckpointStore:
        self.calls += 1
        if self.calls <= self.failures:
            raise sqlite3.OperationalError("database or disk is full")
        return KVCheckpointStore(self.root, NS, 1 << 22)


def _wait(predicate, bound_s: float = 10.0) -> None:
    end = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < end, "not within the bound"
        time.sleep(0.01)


def test_the_tier_is_built_in_the_background_and_handed_over_once(tmp_path: Path) -> None:
    build = Flaky(tmp_path / "disk", failures=2)
    attach = DiskAttach(build, sqlite3.OperationalError("at start"),
                        first_probe_s=0.01, max_probe_s=0.02)
    try:
        assert attach.report().state == "degraded" and "at start" in attach.report().last_error
        _wait(lambda: attach.health.available)
        store = attach.take()
        assert store is not None and build.calls == 3
        assert attach.take() is None  # once
        store.close()
    finally:
        attach.close()


def test_a_tier_built_after_the_engine_stopped_is_closed(tmp_path: Path) -> None:
    build = Flaky(tmp_path / "disk", failures=0)
    attach = DiskAttach(build, OSError("at start"), first_probe_s=0.01)
    _wait(lambda: attach.health.available)
    attach.close()
    assert attach.take() is None
    # Its folder lock was released: another tier opens the folder.
    KVCheckpointStore(tmp_path / "disk", NS, 1 << 22).close()


def test_the_manager_reports_persists_failed_until_attached_then_uses_the_tier(
        tmp_path: Path) -> None:
    from kvci_plugin.governance.decision import EligibilityDecision, PersistenceDerivation
    from kvci_plugin.tiering.manager import TieredCheckpointManager
    from kvci_plugin.tiering.ram.index import RAMIndex

    class NoCopies:
        def store(self, reservation, source):
            return True

        def persist(self, checkpoint_id, tenant, keys, slots):
            return False

    class Permits:
        name = "permits"

        def evaluate(self, request):
            return EligibilityDecision(
                permitted=True, gate=self.name, checkpoint_id=request.checkpoint_id,
                trigger=request.trigger, failed_check=None, reason="permitted",
                derivation=PersistenceDerivation(), evaluated_at=time.time())

    build = Flaky(tmp_path / "disk", failures=1)
    attach = DiskAttach(build, OSError("at start"), first_probe_s=0.01, max_probe_s=0.02)
    manager = TieredCheckpointManager(index=RAMIndex(8, 1024, 8), mover=NoCopies(),
                                      disk_attach=attach, gate=Permits())
    try:
        assert manager.disk_available is False and manager.disk_attaching
        assert manager.ram_stats()["disk"]["health"]["state"] == "degraded"
        keys = [hashlib.sha256(b"k%d" % i).digest()[:16] for i in range(2)]
        kept = manager.checkpoint_now(tenant="acme", keys=keys, trigger="user",
                                      recommendation=None, source=None, persist=True)
        assert kept.persist is not None and kept.persist.status == "failed"
        assert "unavailable" in kept.persist.reason and kept.persist.decision is not None
        _wait(lambda: attach.health.available)
        assert manager.attach_disk() and manager.disk is not None
        assert not manager.disk_attaching and manager.disk_available
        assert manager.attach_disk() is False  # once
        again = manager.promote(kept.checkpoint_id, tenant="acme", trigger="user",
                                session_token=None)
        assert again.status == "persisting", again.reason  # its blobs are being written
    finally:
        manager.close()
        if manager.disk is not None:
            manager.disk.close()
