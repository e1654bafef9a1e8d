"""KVCheckpointStore: the disk tier (a blob location + CheckpointCatalog) behind one object.

In vLLM the two halves live apart (blobs next to the KV cache on the worker side, the catalog on
the scheduler side); this class joins them for the scheduler, and
is where the rules that need both live: blobs are durable before their catalog row exists, rows
are gone before their blobs are deleted, start-up reconciles the two, and ``disk_bytes`` is
enforced after every write.

One node or many. With the embedded SQLite catalog the store owns its folder: it holds an
exclusive lock on it for its lifetime, since reconciliation deletes what the catalog does not
know. With a PostgreSQL catalog (``catalog_url``) the blob location (a shared folder or Redis,
``blob_url``) is shared by every node, and the catalog's leases and locked removals stand in
for the folder lock: a page is leased before its blobs are written, blobs are deleted only
after the catalog transaction that removed their rows has committed (never under the fleet-wide
lock: a slow blob store must not stop every node's writes) and only when no row or live lease
holds them again, and an orphan is only removed once it is older than a lease (a younger one may
belong to a write under way on another node). Every node verifies every blob it reads.

Every call the engine's step makes here runs through ``BoundedCalls`` (``disk.calls``): waited
for at most ``timeouts.statement_s + timeouts.lock_s``, and skipped at once while the tier's
``health`` is degraded (a probe off the step's thread brings it back).

``disk_bytes`` bounds the pages the catalog records, across every node sharing it.

Writing here is not a decision: the persistence eligibility gate runs before ``reserve`` is ever
called, and its decision is what ``decision_json`` records.

``reset`` (a cache reset, after an in-place weight update) starts the next generation of the
namespace: the catalog fences every checkpoint of the last one for every node at once, and keys
change, so no KV computed before a reset is ever loaded after it, a restart included.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from kvci_plugin.tiering.blobs.backend import BlobBackend, BlobRoot
from kvci_plugin.tiering.blobs.codec import check_namespace
from kvci_plugin.tiering.blobs.factory import open_blob_root
from kvci_plugin.tiering.blobs.folder import make_private_dir
from kvci_plugin.tiering.blobs.tenant_keys import RootKeyProvider
from kvci_plugin.tiering.disk.calls import bounded, direct
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.disk.records import (
    DiskStats,
    ForgetReport,
    GenerationFence,
    KVCheckpointRecord,
    PageId,
    PageRef,
    ReconcileReport,
    Removal,
)
from kvci_plugin.tiering.health import BoundedCalls, DependencyHealth, HealthReport
from kvci_plugin.tiering.keys import generation_namespace
from kvci_plugin.tiering.timeouts import DependencyTimeouts
from kvci_plugin.tiering.types import (
    CheckpointExistsError,
    DoesNotFitError,
    PageKey,
    check_checkpoint_id,
    check_page_key,
    check_tenant,
)

CATALOG_NAME = "catalog.sqlite3"
LOCK_NAME = "lock"
TOUCH_FLUSH_S = 1.0
"""Longest a page's use waits to be recorded in the catalog (see ``KVCheckpointStore.touch``)."""
DEFAULT_LEASE_S = 600.0
"""How long a writer's lease on its pages lasts: longer than any blob write takes."""
_PROBE_KEY = bytes(16)  # a page key no write makes: the probe asks whether its blob exists


def _check_keys(keys: Sequence[PageKey]) -> tuple[PageKey, ...]:
    if isinstance(keys, (bytes, str)):
        raise TypeError("keys must be a sequence of 16-byte page keys, not a single bytes/str")
    checked = tuple(check_page_key(k) for k in keys)
    if not checked:
        raise ValueError("keys must not be empty")
    return checked


class KVCheckpointStore:
    """Durable, verified, bounded, tenant-checked KV checkpoints.

    ``root``: the folder of the blobs (unless ``blob_url`` names Redis) and of the SQLite
    catalog (unless ``catalog_url`` names PostgreSQL). ``shards``: the namespaces the other
    tensor-parallel ranks write this engine's blobs under. ``root_key``: the node's root key,
    which seals the blobs with the tenant material (default: the node's state_dir secret).
    ``timeouts``: how long a call waits on the catalog database and the blob store.
    """

    def __init__(
        self,
        root: Path | None,
        namespace: bytes,
        disk_bytes: int,
        clock: Callable[[], float] = time.time,
        *,
        catalog_url: str | None = None,
        blob_url: str | None = None,
        shards: Sequence[bytes] = (),
        lease_s: float = DEFAULT_LEASE_S,
        root_key: RootKeyProvider | None = None,
        timeouts: DependencyTimeouts = DependencyTimeouts(),
    ) -> None:
        if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int):
            raise TypeError(f"disk_bytes must be an int, not {type(disk_bytes).__name__}")
        if disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be > 0, not {disk_bytes}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, not {lease_s!r}")
        if root is None and (catalog_url is None or blob_url is None):
            raise ValueError("root is needed unless both catalog_url and blob_url are given")
        self._root = None if root is None else Path(root)
        self._base = self._namespace = check_namespace(namespace)
        self._generation = 0
        self._disk_bytes = disk_bytes
        self._clock = clock
        self._lease_s = float(lease_s)
        self._shared = catalog_url is not None
        self._write_lock = threading.RLock()
        self._touch_lock = threading.Lock()
        self._touched: set[PageKey] = set()
        self._touched_since: float | None = None
        self._lock_fd: int | None = None
        # Told the keys of this namespace's pages as their rows and blobs go (see TierListener).
        self.on_pages_removed: Callable[[Sequence[PageKey]], None] | None = None
        if self._root is not None:
            make_private_dir(self._root)
        if not self._shared:
            assert self._root is not None
            self._lock_fd = self._take_lock()
        self._blob_root: BlobRoot | None = None
        self.health = DependencyHealth("disk tier", self._probe)
        # The longest a caller (the engine's step) waits for one call: a statement, and the
        # catalog lock it may wait for first.
        self._calls = BoundedCalls(self.health, timeouts.statement_s + timeouts.lock_s)
        try:
            self._blob_root = open_blob_root(blob_url, self._root, root_key, timeouts)
            self._catalog = CheckpointCatalog(
                None if self._shared else self._root / CATALOG_NAME, clock, url=catalog_url,
                timeouts=timeouts,
            )
            self._base_shards = tuple(check_namespace(ns) for ns in shards if ns != namespace)
            if not self._shared:
                # The folder lock is ours: a lease left in the catalog is a dead writer's.
                self._catalog.release_all()
            self._enter_generation(self._catalog.generation(self._base))
            self._erasure_epoch = self._catalog.erasure_epoch()
            self.last_reconcile = self.reconcile()
        except BaseException:
            self._release_resources()
            raise

    @property
    def root(self) -> Path | None:
        return self._root

    @property
    def namespace(self) -> bytes:
        """The namespace keys are made in now: the engine's, in its current generation."""
        return self._namespace

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def erasure_epoch(self) -> int:
        """The catalog's erasure epoch as this node last read it (at start, at its own forgets,
        at ``refresh_erasures``): a read of one attribute. A write's KV computed while it was
        ``e`` is refused for a tenant whose last forget began a later epoch."""
        return self._erasure_epoch

    @bounded("reading erasures")
    def refresh_erasures(self) -> dict[str, int]:
        """Read the tenants other nodes have forgotten since this node last looked (one indexed
        query), with their forget's epoch; ``erasure_epoch`` moves to the latest."""
        found = self._catalog.forgotten_since(self._erasure_epoch)
        if found:
            self._erasure_epoch = max(self._erasure_epoch, *found.values())
        return found

    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    @property
    def shared(self) -> bool:
        """Whether other nodes may share the catalog and the blobs."""
        return self._shared

    def describe(self) -> str:
        assert self._blob_root is not None
        return f"blobs: {self._blob_root.describe()}; catalog: {self._catalog.describe()}"

    def close(self) -> None:
        try:
            self.flush_touches()
            self._calls.run("closing the catalog", self._catalog.close, when_degraded=True)
        except Exception:  # noqa: BLE001 - recency only; the catalog's data is committed
            pass
        finally:
            self._release_resources()

    def health_report(self) -> HealthReport:
        return self.health.report()

    def _probe(self) -> None:
        """Ask the catalog and the blob store something cheap (on the calls' thread, so a
        probe waits behind a call still stuck); raises while either does not answer."""
        def ask() -> None:
            self._catalog.schema_version()
            self._blobs.exists(_PROBE_KEY)

        self._calls.run("probe", ask, when_degraded=True)

    def _release_resources(self) -> None:
        self._calls.close()
        if self._blob_root is not None:
            self._blob_root.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> KVCheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- maintenance ------------------------------------------------------------------------

    @direct
    def reconcile(self) -> ReconcileReport:
        """Make the blobs and the catalog agree, then apply retention and the bound.

        Removes temp files of interrupted writes and blobs no page row or live lease names (a
        write that never reached its catalog row, or a deletion lost in a crash) — on a shared
        location only those older than a lease; drops page rows whose blob has vanished, with
        the checkpoints that need them (on a shared catalog only this engine's: other engines
        reconcile their own). Blob contents are verified at every load, not here: reading every
        blob would make start-up as slow as the disk is big.
        """
        assert self._blob_root is not None
        min_age = self._lease_s if self._shared else 0.0
        with self._write_lock:
            temps = self._blob_root.sweep_temps(min_age)
            candidates = [b for b in self._blob_root.listing() if b.age_s >= min_age]
            orphans = 0
            with self._catalog.locked():
                known = self._catalog.known_blobs()
                for blob in candidates:
                    if (blob.namespace_prefix, blob.key_hex) not in known:
                        self._blob_root.remove(blob)
                        orphans += 1
            rows = [
                page
                for page, _ in self._catalog.pages()
                if not self._shared or page.namespace == self._namespace
            ]
            vanished = [page for page in rows if not self._store(page.namespace).exists(page.key)]
            lost = self._drop(vanished)
            expired = self.gc_expired()
            evicted = self._enforce_bound()
            return ReconcileReport(temps, orphans, lost, expired, evicted)

    @bounded("retention GC")
    def gc_expired(self, now: float | None = None) -> Removal:
        """Remove checkpoints and pages whose retention has expired, blobs included."""
        with self._write_lock, self._catalog.locked():
            removal = self._catalog.gc_expired(self._clock() if now is None else now)
        self._delete_removed(removal)
        return removal

    @bounded("a cache reset", when_degraded=True)
    def reset(self) -> GenerationFence:
        """A cache reset: fence every checkpoint of the current generation, on every node that
        shares the catalog, and key in the next generation from now on (kept in the catalog, so
        a restart keeps the fence). The fenced pages' blobs are deleted."""
        with self._write_lock, self._catalog.locked():
            with self._touch_lock:
                self._touched, self._touched_since = set(), None  # the fenced generation's pages
            new, removal = self._catalog.advance_generation(
                self._base, self._generation, self._namespace)
            self._enter_generation(new)
        self._delete_removed(removal)
        return GenerationFence(generation=new, checkpoint_ids=removal.checkpoint_ids)

    @bounded("a forget", when_degraded=True)
    def forget(self, tenant: str) -> ForgetReport:
        """Crypto-erase ``tenant``: its catalog rows go (for every node sharing the catalog, at
        once), its key material is destroyed (no node can open its blobs again, whoever kept a
        copy), then its blobs are deleted. Writes computed before now are never recorded. The
        report names the erasure epoch it began; ``erasure_epoch`` moves at the next
        ``refresh_erasures`` (which then also finds the forgets other nodes made before it)."""
        check_tenant(tenant)
        assert self._blob_root is not None
        with self._write_lock, self._catalog.locked():
            removal, epoch = self._catalog.forget_tenant(tenant)
            destroyed = self._blob_root.keys.forget(tenant)
            with self._touch_lock:
                self._touched -= {page.key for page in removal.pages}
        self._delete_removed(removal)  # unreadable already: the key material is gone
        return ForgetReport(removal.checkpoint_ids, len(removal.pages), destroyed, epoch)

    @bounded("reading a forget record")
    def forgotten(self, checkpoint_id: str) -> tuple[str, float] | None:
        """(tenant, forgotten_at) of a checkpoint a forget erased, or None."""
        return self._catalog.forgotten(checkpoint_id)

    @bounded("reading a reset record")
    def fenced(self, checkpoint_id: str) -> tuple[str, float, int] | None:
        """(tenant, fenced_at, generation begun) of a checkpoint a cache reset fenced."""
        return self._catalog.fenced(checkpoint_id)

    @bounded("ending a lease")
    def end_lease(self, checkpoint_id: str) -> None:
        """End the lease of a write that a reset fenced: it is never recorded, and its blobs,
        named by no row, go at the next reconcile."""
        self._catalog.release(check_checkpoint_id(checkpoint_id))

    def _enter_generation(self, generation: int) -> None:
        assert self._blob_root is not None
        self._generation = generation
        self._namespace = generation_namespace(self._base, generation)
        self._shards = tuple(generation_namespace(ns, generation) for ns in self._base_shards)
        if self._shards:
            self._catalog.register_shards(self._namespace, self._shards)
        self._blobs = self._blob_root.store(self._namespace)
        self._stores: dict[bytes, BlobBackend] = {self._namespace: self._blobs}

    # ---- writes -----------------------------------------------------------------------------

    @bounded("leasing pages")
    def reserve(self, checkpoint_id: str, keys: Sequence[PageKey], tenant: str,
                computed_epoch: int | None = None) -> None:
        """Lease ``keys`` to ``tenant``'s write of ``checkpoint_id`` before any of its blobs is
        written; ``record_written`` or ``release`` ends the lease. The tenant's key material is
        made here if it has none: writers never make it, so a write still under way when the
        tenant is forgotten fails rather than making material that would open what it wrote.
        ``computed_epoch``: the erasure epoch known when the KV was computed; a write of KV
        computed before the tenant's last forget is refused here (``TenantForgottenError``),
        before any blob is written."""
        assert self._blob_root is not None
        self._blob_root.keys.ensure(tenant)
        self._catalog.lease(
            self._namespace, _check_keys(keys), check_checkpoint_id(checkpoint_id),
            self._clock() + self._lease_s, tenant, computed_epoch,
        )

    @bounded("releasing a write")
    def release(self, checkpoint_id: str, keys: Sequence[PageKey] = ()) -> None:
        """End a write that will not be recorded: its lease goes, and the blobs of ``keys`` no
        row and no other lease holds are deleted."""
        self._abandon(check_checkpoint_id(checkpoint_id), tuple(keys))

    @bounded("recording a checkpoint")
    def record_written(
        self,
        checkpoint_id: str,
        tenant: str,
        keys: Sequence[PageKey],
        slot_bytes: int,
        trigger: Literal["user", "agent", "system"],
        recommendation_json: str,
        decision_json: str,
        retention_expiry: float | None,
        computed_epoch: int | None = None,
    ) -> KVCheckpointRecord:
        """Record a checkpoint whose blobs another process has written and made durable.

        The split of vLLM: the workers write the blobs of every shard namespace, then the
        scheduler calls this. Every shard's blob must exist (``BlobMissingError`` otherwise:
        nothing is recorded); contents are verified when they are loaded. ``computed_epoch``:
        the erasure epoch known when the KV was computed (``TenantForgottenError`` if the
        tenant was forgotten since).
        """
        keys = _check_keys(keys)
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be an int > 0, not {slot_bytes!r}")
        record = self._new_record(
            checkpoint_id, tenant, keys, slot_bytes, trigger, recommendation_json,
            decision_json, retention_expiry,
        )
        return self._record(record, lambda: [self._blob_size(k) for k in keys], computed_epoch)

    @bounded("discarding bad pages")
    def discard(self, keys: Sequence[PageKey]) -> Removal:
        """Forget pages a reader found missing or corrupt, with the checkpoints that need them,
        so they are never offered again (a bad blob must cost one recompute, not a livelock)."""
        return self._drop([PageId(self._namespace, k) for k in _check_keys(keys)])

    def touch(self, keys: Sequence[PageKey]) -> None:
        """Mark pages used (a load of them is under way elsewhere), and their checkpoints.

        Recorded in the catalog at most ``TOUCH_FLUSH_S`` later, and always before this store
        evicts: a catalog write on every disk hit put a commit (an fsync, or a round trip to a
        shared catalog) in the way of the load. Only recency waits; another node's eviction may
        take a page in that window, and its load then fails cleanly and is recomputed.
        """
        checked = _check_keys(keys)
        with self._touch_lock:
            self._touched.update(checked)
            now = self._clock()
            if self._touched_since is None:
                self._touched_since = now
            due = now - self._touched_since >= TOUCH_FLUSH_S
        if due:
            self.flush_touches()

    @bounded("recording page use")
    def flush_touches(self) -> None:
        """Record the pages touched since the last flush as used now."""
        with self._touch_lock:
            keys, self._touched, self._touched_since = tuple(self._touched), set(), None
        if keys:
            self._catalog.touch(self._namespace, keys)

    # ---- reads ------------------------------------------------------------------------------

    @bounded("a lookup")
    def longest_prefix(self, keys: Sequence[PageKey], tenant: str) -> int:
        """How many leading ``keys`` the disk tier holds for ``tenant``. Changes nothing."""
        return self._catalog.longest_prefix(self._namespace, keys, tenant)

    @bounded("reading a checkpoint record")
    def explain(self, checkpoint_id: str) -> KVCheckpointRecord | None:
        """The raw record; the caller checks tenancy before showing it."""
        return self._catalog.find(checkpoint_id)

    @bounded("reading the tier's stats")
    def stats(self) -> DiskStats:
        catalog = self._catalog.stats()
        return DiskStats(
            checkpoints=catalog.checkpoints,
            pages=catalog.pages,
            unreferenced_pages=catalog.unreferenced_pages,
            bytes_used=catalog.bytes_used,
            capacity_bytes=self._disk_bytes,
            quarantined=self._blobs.quarantined(),
        )

    # ---- helpers ----------------------------------------------------------------------------

    def _take_lock(self) -> int:
        assert self._root is not None
        fd = os.open(self._root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{self._root} is in use by another KVCheckpointStore") from None
        return fd

    def _new_record(
        self,
        checkpoint_id: str,
        tenant: str,
        keys: tuple[PageKey, ...],
        slot_bytes: int,
        trigger: Literal["user", "agent", "system"],
        recommendation_json: str,
        decision_json: str,
        retention_expiry: float | None,
    ) -> KVCheckpointRecord:
        """Validate a checkpoint before any blob is touched; its pages carry payload sizes."""
        check_checkpoint_id(checkpoint_id)
        check_tenant(tenant)
        if len(keys) * slot_bytes > self._disk_bytes:
            raise DoesNotFitError(
                "disk_bytes",
                f"checkpoint {checkpoint_id} has {len(keys) * slot_bytes} bytes of pages, more "
                f"than disk_bytes ({self._disk_bytes})",
            )
        if self._catalog.find(checkpoint_id) is not None:
            raise CheckpointExistsError(f"checkpoint {checkpoint_id} already exists")
        now = self._clock()
        if retention_expiry is not None and retention_expiry <= now:
            raise ValueError(f"checkpoint {checkpoint_id}: retention_expiry has passed")
        return KVCheckpointRecord(
            checkpoint_id=checkpoint_id,
            tenant=tenant,
            namespace=self._namespace.hex(),
            trigger=trigger,
            recommendation_json=recommendation_json,
            decision_json=decision_json,
            created=now,
            retention_expiry=retention_expiry,
            last_used=now,
            slot_bytes=slot_bytes,
            pages=tuple(PageRef(key=k.hex(), nbytes=slot_bytes) for k in keys),
        )

    def _record(
        self, record: KVCheckpointRecord, blob_sizes: Callable[[], list[int]],
        computed_epoch: int | None = None,
    ) -> KVCheckpointRecord:
        """Add the catalog row once ``blob_sizes`` finds every blob, then apply the bound.

        The blobs are measured before the catalog's lock is taken: a stat on a shared folder or
        a STRLEN on Redis must not hold up every node's catalog writes. A blob another node
        deletes between its measurement and the row (it removed the page's last row just before
        this write leased it) leaves a row whose load fails cleanly and is discarded: a miss,
        never wrong KV.
        """
        keys = record.page_keys
        try:
            sizes = blob_sizes()
            if sum(sizes) > self._disk_bytes:
                raise DoesNotFitError(
                    "disk_bytes",
                    f"checkpoint {record.checkpoint_id} does not fit in disk_bytes "
                    f"({self._disk_bytes}) once its blob headers are counted",
                )
            pages = tuple(PageRef(key=k.hex(), nbytes=n) for k, n in zip(keys, sizes))
            record = record.model_copy(update={"pages": pages})
            with self._write_lock:
                self._catalog.add_checkpoint(record, holder=record.checkpoint_id,
                                             computed_epoch=computed_epoch)
        except BaseException:
            self._abandon(record.checkpoint_id, keys)
            raise
        self.gc_expired(record.created)
        self._enforce_bound(protect=record.checkpoint_id)
        return record

    def _abandon(self, checkpoint_id: str, keys: Sequence[PageKey]) -> None:
        """Drop a write's lease, then the blobs it left that no row or other lease holds."""
        with self._write_lock:
            self._catalog.release(checkpoint_id)
        self._delete_unheld(self._namespace, keys)

    def _blob_size(self, key: PageKey) -> int:
        """The bytes of every shard's blob of ``key``; ``BlobMissingError`` if one is missing."""
        return sum(self._store(ns).size(key) for ns in (self._namespace, *self._shards))

    def _drop(self, pages: Sequence[PageId]) -> Removal:
        with self._write_lock:
            removal = self._catalog.drop_pages(pages)
        self._delete_removed(removal)
        return removal

    def _enforce_bound(self, protect: str | None = None) -> Removal:
        self.flush_touches()
        with self._write_lock:
            removal = self._catalog.evict_to(self._disk_bytes, protect)
        self._delete_removed(removal)
        return removal

    def _delete_removed(self, removal: Removal) -> None:
        """Delete the blobs of a removal whose transaction has committed (see
        ``_delete_unheld``), and tell the listener its pages are gone."""
        by_namespace: dict[bytes, list[PageKey]] = {}
        for page in removal.pages:
            by_namespace.setdefault(page.namespace, []).append(page.key)
        for namespace, keys in by_namespace.items():
            self._delete_unheld(namespace, keys)
        if self.on_pages_removed is not None and removal.pages:
            self.on_pages_removed([p.key for p in removal.pages if p.namespace == self._namespace])

    def _delete_unheld(self, namespace: bytes, keys: Sequence[PageKey]) -> None:
        """Delete the blobs of ``keys`` that no page row and no live lease holds.

        Runs after the transaction that removed their rows or lease has committed, outside the
        catalog's lock: a blob store that is slow or hangs (Redis, NFS) must not hold up every
        node's catalog writes. A write that leases one of these pages between the check here
        and the deletion loses its blob: it then fails to record, or records a row whose load
        fails cleanly and is discarded. A miss, never wrong KV.
        """
        if not keys:
            return
        taken = self._catalog.held_pages(namespace, keys) | self._catalog.leased(namespace, keys)
        for key in keys:
            if key not in taken:
                self._delete_page_blobs(namespace, key)

    def _delete_page_blobs(self, namespace: bytes, key: PageKey) -> None:
        shards = self._shards if namespace == self._namespace else ()
        if not shards and namespace != self._namespace:
            shards = self._catalog.shards().get(namespace, ())
        for ns in (namespace, *shards):
            self._store(ns).delete(key)

    def _store(self, namespace: bytes) -> BlobBackend:
        store = self._stores.get(namespace)
        if store is None:
            assert self._blob_root is not None
            store = self._stores[namespace] = self._blob_root.store(namespace)
        return store
