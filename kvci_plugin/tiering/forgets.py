"""Forgetting a tenant, on this node and as other nodes learn of it: the manager's part of a
crypto-erasure (``TenantErasure``, a part of ``TieredCheckpointManager``).

A forget is two parts: the RAM part under the manager's lock (fast: no dependency is asked), then
the disk tier's part on the caller's thread, outside the lock (a catalog transaction bounded by
the tier's call bound): the scheduler never waits on a dependency for a forget. Erasure epochs
(``erasures``) say which KV was computed before a forget, on every node sharing the catalog.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.erasures import ERASURE_SYNC_S, ErasureEpochs, ErasureWatch
from kvci_plugin.tiering.explain import Tombstones
from kvci_plugin.tiering.loadable import LoadablePages
from kvci_plugin.tiering.outcomes import ForgetOutcome
from kvci_plugin.tiering.persists import Persists
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.retention import Retentions

logger = logging.getLogger(__name__)


class TenantErasure:
    """The forget and the erasure epochs of a ``TieredCheckpointManager`` (which owns every
    attribute named below)."""

    lock: threading.RLock
    disk: KVCheckpointStore | None
    index: RAMIndex
    retentions: Retentions
    _clock: Callable[[], float]
    _erasures: ErasureEpochs
    _between_lookups: Callable[[Callable[[], Any]], Any]
    _watch_failed: Callable[[BaseException], None]
    _watch: ErasureWatch | None
    _tombstones: Tombstones
    _loadable: LoadablePages | None
    _persists: Persists

    def forget(self, tenant: str) -> ForgetOutcome:
        """Crypto-erase ``tenant`` (the caller checked the authority): ``forget_ram``, then
        ``forget_disk``. Other nodes' RAM tiers erase it when they learn of it
        (``sync_erasures``)."""
        return self.forget_disk(tenant, self.forget_ram(tenant))

    def forget_ram(self, tenant: str) -> ForgetOutcome:
        """The part of a forget that touches only this process, under the lock (fast: no
        dependency is asked): RAM forgets the tenant's checkpoints (copies in flight included:
        their reports record nothing), its retentions end, its persists under way are never
        recorded, and KV kept from now on that was computed before it is refused
        (``checkpoint_now``'s ``erasure_epoch``). The disk tier's part follows, outside the
        lock: ``forget_disk``. Its disk fields are 0 until then."""
        with self.lock:
            now = self._clock()
            self._erasures.mark(tenant, self.erasure_epoch + 1)
            ram = self._erase_ram(tenant, now)
        return ForgetOutcome(ram_checkpoints=ram, disk_checkpoints=0, key_destroyed=False)

    def forget_disk(self, tenant: str, ram: ForgetOutcome) -> ForgetOutcome:
        """The disk tier's part of a forget, after ``forget_ram`` and *outside* the manager's
        lock (a catalog transaction and the key material's tombstone, bounded by the tier's
        call bound): its key material and rows go for every node sharing the catalog, then its
        blobs. A persist leased between the two parts is never recorded: the disk tier's forget
        ends the tenant's registered writes in its transaction, and begins an erasure epoch
        later than the one that persist's KV was computed at (``add_checkpoint``). Raises what
        the disk tier raised: the forget is to be asked again."""
        disk = self.disk
        if disk is None:
            return ram
        try:
            report = disk.forget(tenant)
        except BaseException:
            with self.lock:  # not forgotten on disk: new KV of the tenant is kept again
                self._erasures.lower(tenant, self.erasure_epoch)
            raise
        with self.lock:
            self._erasures.mark(tenant, report.erasure_epoch)
        try:  # this forget's epoch (and other nodes' before it): new KV is kept again
            self.sync_erasures()
        except Exception as exc:  # noqa: BLE001 - the next sync learns it
            logger.warning("kvci: reading the erasure epoch after a forget failed: %s", exc)
        return ForgetOutcome(
            ram_checkpoints=ram.ram_checkpoints,
            disk_checkpoints=len(report.checkpoint_ids),
            key_destroyed=report.key_destroyed,
        )

    # ---- erasure epochs -------------------------------------------------------------------

    @property
    def erasure_epoch(self) -> int:
        """The erasure epoch known now (a read of one attribute): what KV computed from now on
        is stamped with (``checkpoint_now``'s ``erasure_epoch``). With a disk tier, its
        catalog's as this node last read it; each forget begins a later one."""
        return self.disk.erasure_epoch if self.disk is not None else self._erasures.local_epoch

    def erased_at(self, tenant: str) -> int:
        """The epoch of ``tenant``'s last forget known here: KV stamped with an older epoch
        was computed before it."""
        return self._erasures.erased_at(tenant)

    def erasures_between_lookups(self, run: Callable[[Callable[[], Any]], Any]) -> None:
        """Apply erasures learned from other nodes through ``run`` (the scheduler's lookup
        window: never between a step's lookup and its loads' pins)."""
        self._between_lookups = run

    def watch_faults(self, failed: Callable[[BaseException], None]) -> None:
        """Hand a failure to read other nodes' forgets (on the watch's own thread) to
        ``failed``: the scheduler counts it as a disk fault, since the incident that degrades
        the tier may begin there rather than on the engine's step."""
        self._watch_failed = failed

    def sync_erasures(self) -> tuple[str, ...]:
        """Learn the tenants other nodes sharing the catalog have forgotten since this node
        last looked (one indexed read), and erase them from this node's RAM tier: their
        checkpoints, retentions and persists under way, and what is kept afterwards of KV
        computed before. Runs on a thread of its own every ``ERASURE_SYNC_S`` (a shared disk
        tier), and after each forget here. Returns the tenants erased now."""
        disk = self.disk
        if disk is None:
            return ()
        found = disk.refresh_erasures()
        if not found:
            return ()

        def erase() -> tuple[str, ...]:
            erased = []
            with self.lock:
                now = self._clock()
                for tenant, epoch in found.items():
                    if not self._erasures.knows(tenant, epoch):
                        self._erasures.mark(tenant, epoch)
                        self._erase_ram(tenant, now)
                        erased.append(tenant)
            return tuple(erased)

        erased = self._between_lookups(erase)
        if erased:
            logger.info("kvci: erased %d tenant(s) another node forgot from RAM", len(erased))
        return erased

    def _watch_erasures(self) -> None:
        """With a disk tier shared with other nodes: learn their forgets off the engine's
        threads (``sync_erasures`` every ``ERASURE_SYNC_S``)."""
        if self.disk is None or not self.disk.shared or self._watch is not None:
            return
        # Looked up at each failure: the scheduler sets ``watch_faults`` after the watch starts.
        self._watch = ErasureWatch(self.sync_erasures, ERASURE_SYNC_S,
                                   lambda exc: self._watch_failed(exc))

    def _erase_ram(self, tenant: str, now: float) -> int:
        """(Lock held.) This process's part of erasing ``tenant``; how many RAM checkpoints."""
        self.retentions.forget(tenant)
        ram = self.index.erase(tenant, unloaded_keys=self._loadable is not None)
        self._tombstones.forget(ram.checkpoint_ids, tenant, now)
        if self._loadable is not None:  # kv events: the erased pages stop being loadable
            self._loadable.removed("ram", ram.unloaded)
        self._persists.fence_tenant(tenant)
        return len(ram.checkpoint_ids)
