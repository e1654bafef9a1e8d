"""KVCheckpointStore: the disk tier in one process (BlobStore + CheckpointCatalog).

In vLLM the two halves live apart (blobs next to the KV cache on the worker side, the catalog on
the scheduler side); this class joins them for single-process use and tests, and is where the
rules that need both live: blobs are durable before their catalog row exists, rows are gone
before their blobs are deleted, start-up reconciles the two, and ``disk_bytes`` is enforced after
every write.

The store holds an exclusive lock on its folder for its lifetime: reconciliation deletes files
the catalog does not know, which is only safe when no other process writes there. Within the
process, changes are serialized (lookups are not), so that one write's clean-up or eviction
never deletes a blob another write is about to record.

Writing here is not a decision: the persistence eligibility gate runs before ``persist`` is ever
called, and its decision is what ``decision_json`` records.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kvci_plugin.tiering.blob_store import (
    BlobMissingError,
    BlobStore,
    BlobUnavailableError,
    blob_files,
    check_namespace,
    make_private_dir,
    temp_files,
)
from kvci_plugin.tiering.catalog import (
    CheckpointCatalog,
    KVCheckpointRecord,
    PageId,
    PageRef,
    Removal,
)
from kvci_plugin.tiering.types import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DoesNotFitError,
    PageKey,
    check_checkpoint_id,
    check_page_key,
    check_tenant,
)

CATALOG_NAME = "catalog.sqlite3"
LOCK_NAME = "lock"


@dataclass(frozen=True)
class ReconcileReport:
    """What start-up reconciliation found and repaired."""

    temp_files: int
    orphan_blobs: int
    lost: Removal
    """Pages whose blob had vanished, and the checkpoints that needed them."""
    expired: Removal
    evicted: Removal


@dataclass(frozen=True)
class DiskStats:
    """Occupancy of the disk tier. Numbers only."""

    checkpoints: int
    pages: int
    unreferenced_pages: int
    bytes_used: int
    capacity_bytes: int
    quarantined: int


def _check_pages(pages: object, n: int) -> torch.Tensor:
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"pages must be a torch.Tensor, not {type(pages).__name__}")
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.device.type != "cpu":
        raise ValueError(
            f"pages must be a 2-D uint8 CPU tensor, not {pages.dim()}-D {pages.dtype} on "
            f"{pages.device}"
        )
    if pages.shape[0] != n or pages.shape[1] == 0:
        raise ValueError(f"pages must have shape ({n}, slot_bytes > 0), not {tuple(pages.shape)}")
    return pages


def _check_keys(keys: Sequence[PageKey]) -> tuple[PageKey, ...]:
    if isinstance(keys, (bytes, str)):
        raise TypeError("keys must be a sequence of 16-byte page keys, not a single bytes/str")
    checked = tuple(check_page_key(k) for k in keys)
    if not checked:
        raise ValueError("keys must not be empty")
    return checked


class KVCheckpointStore:
    """Durable, verified, bounded, tenant-checked KV checkpoints under one folder."""

    def __init__(
        self,
        root: Path,
        namespace: bytes,
        disk_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int):
            raise TypeError(f"disk_bytes must be an int, not {type(disk_bytes).__name__}")
        if disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be > 0, not {disk_bytes}")
        self._root = Path(root)
        self._namespace = check_namespace(namespace)
        self._disk_bytes = disk_bytes
        self._clock = clock
        self._write_lock = threading.RLock()
        make_private_dir(self._root)
        self._lock_fd = self._take_lock()
        try:
            self._catalog = CheckpointCatalog(self._root / CATALOG_NAME, clock)
            self._blobs = BlobStore(self._root, namespace)
            self._stores: dict[bytes, BlobStore] = {namespace: self._blobs}
            self.last_reconcile = self.reconcile()
        except BaseException:
            os.close(self._lock_fd)
            raise

    @property
    def root(self) -> Path:
        return self._root

    @property
    def namespace(self) -> bytes:
        return self._namespace

    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    def close(self) -> None:
        self._catalog.close()
        os.close(self._lock_fd)

    def __enter__(self) -> KVCheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- maintenance ------------------------------------------------------------------------

    def reconcile(self) -> ReconcileReport:
        """Make the folder and the catalog agree, then apply retention and the bound.

        Removes temp files of interrupted writes and blobs no page row names (a write that
        never reached its catalog row, or a deletion lost in a crash); drops page rows whose
        blob has vanished, with the checkpoints that need them. Blob contents are verified at
        every load, not here: reading every blob would make start-up as slow as the disk is big.
        """
        with self._write_lock:
            temps = 0
            for path in temp_files(self._root):
                path.unlink(missing_ok=True)
                temps += 1
            rows = self._catalog.pages()
            known = {(page.namespace.hex()[:32], page.key.hex()) for page, _ in rows}
            orphans = 0
            for ns_prefix, key_hex, path in blob_files(self._root):
                if (ns_prefix, key_hex) not in known:
                    path.unlink(missing_ok=True)
                    orphans += 1
            vanished = [
                page for page, _ in rows if not self._store(page.namespace).exists(page.key)
            ]
            lost = self._catalog.drop_pages(vanished)
            expired = self.gc_expired()
            evicted = self._enforce_bound()
            return ReconcileReport(temps, orphans, lost, expired, evicted)

    def gc_expired(self, now: float | None = None) -> Removal:
        """Remove checkpoints and pages whose retention has expired, blobs included."""
        with self._write_lock:
            removal = self._catalog.gc_expired(self._clock() if now is None else now)
            self._delete_blobs(removal)
            return removal

    # ---- writes -----------------------------------------------------------------------------

    def persist(
        self,
        checkpoint_id: str,
        tenant: str,
        keys: Sequence[PageKey],
        pages: torch.Tensor,
        trigger: Literal["user", "agent", "system"],
        recommendation_json: str,
        decision_json: str,
        retention_expiry: float | None,
    ) -> KVCheckpointRecord:
        """Write a checkpoint the eligibility gate has permitted: blobs, then its catalog row.

        ``pages[i]`` is the page of ``keys[i]``. Returns the record as stored. Older
        checkpoints may be evicted to stay within ``disk_bytes``.
        """
        keys = _check_keys(keys)
        pages = _check_pages(pages, len(keys))
        record = self._new_record(
            checkpoint_id, tenant, keys, pages.shape[1], trigger, recommendation_json,
            decision_json, retention_expiry,
        )
        return self._record(record, lambda: self._blobs.write_many(keys, tenant, pages))

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
    ) -> KVCheckpointRecord:
        """Record a checkpoint whose blobs another process has written and made durable.

        The split of vLLM: the worker's ``BlobStore`` writes the blobs of this namespace, then
        the scheduler calls this. Every blob must exist (``BlobMissingError`` otherwise: nothing
        is recorded); contents are verified when they are loaded.
        """
        keys = _check_keys(keys)
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be an int > 0, not {slot_bytes!r}")
        record = self._new_record(
            checkpoint_id, tenant, keys, slot_bytes, trigger, recommendation_json,
            decision_json, retention_expiry,
        )
        return self._record(record, lambda: [self._blob_size(k) for k in keys])

    def discard(self, keys: Sequence[PageKey]) -> Removal:
        """Forget pages a reader found missing or corrupt, with the checkpoints that need them,
        so they are never offered again (a bad blob must cost one recompute, not a livelock)."""
        removal = self._catalog.drop_pages(PageId(self._namespace, k) for k in _check_keys(keys))
        self._delete_blobs(removal)
        return removal

    def touch(self, keys: Sequence[PageKey]) -> None:
        """Mark pages used now (a load of them is under way elsewhere), and their checkpoints."""
        self._catalog.touch(self._namespace, _check_keys(keys))

    # ---- reads ------------------------------------------------------------------------------

    def load(self, checkpoint_id: str, tenant: str) -> torch.Tensor:
        """The pages of ``tenant``'s checkpoint as a (pages, slot_bytes) uint8 tensor.

        Refuses another tenant's valid id (``TenantMismatchError``) and a checkpoint of another
        namespace (``CheckpointNotFoundError``: its KV belongs to another model or layout). A
        page that fails verification raises ``BlobUnavailableError`` and is forgotten along with
        the checkpoints that need it.
        """
        record = self._catalog.get(checkpoint_id, tenant)
        if record.namespace != self._namespace.hex():
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id} belongs to another namespace (model, KV layout or "
                "format)"
            )
        keys = record.page_keys
        out = torch.empty((len(keys), record.slot_bytes), dtype=torch.uint8)
        for i, key in enumerate(keys):
            self._read(key, tenant, out[i])
        self._catalog.touch(self._namespace, keys)
        return out

    def load_prefix(self, keys: Sequence[PageKey], tenant: str) -> torch.Tensor:
        """The longest loadable prefix of ``keys`` for ``tenant`` as a (n, slot_bytes) tensor.

        Stops at the first page that fails verification (which is forgotten); (0, 0) when no
        page loads.
        """
        keys = _check_keys(keys)
        n = self.longest_prefix(keys, tenant)
        out: torch.Tensor | None = None
        loaded = 0
        for i in range(n):
            try:
                page = self._read(keys[i], tenant, None if out is None else out[i])
            except BlobUnavailableError:
                break
            if out is None:
                out = torch.empty((n, page.numel()), dtype=torch.uint8)
                out[0].copy_(page)
            loaded += 1
        if out is None or loaded == 0:
            return torch.empty((0, 0), dtype=torch.uint8)
        self._catalog.touch(self._namespace, keys[:loaded])
        return out[:loaded]

    def longest_prefix(self, keys: Sequence[PageKey], tenant: str) -> int:
        """How many leading ``keys`` the disk tier holds for ``tenant``. Changes nothing."""
        return self._catalog.longest_prefix(self._namespace, keys, tenant)

    def explain(self, checkpoint_id: str) -> KVCheckpointRecord | None:
        """The raw record; the caller checks tenancy before showing it."""
        return self._catalog.find(checkpoint_id)

    def list(self, tenant: str | None = None) -> list[KVCheckpointRecord]:
        """Checkpoint records, oldest first, optionally of one tenant only."""
        return self._catalog.list(tenant)

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
        self, record: KVCheckpointRecord, blob_sizes: Callable[[], list[int]]
    ) -> KVCheckpointRecord:
        """Add the catalog row once ``blob_sizes`` has the blobs durable, then apply the bound."""
        keys = record.page_keys
        with self._write_lock:
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
                self._catalog.add_checkpoint(record)
            except BaseException:
                # Blobs of this checkpoint that no row names; shared pages already held stay.
                held = self._catalog.held_pages(self._namespace, keys)
                for key in keys:
                    if key not in held:
                        self._blobs.delete(key)
                raise
            self.gc_expired(record.created)
            self._enforce_bound(protect=record.checkpoint_id)
        return record

    def _blob_size(self, key: PageKey) -> int:
        try:
            return self._blobs.path_for(key).stat().st_size
        except FileNotFoundError:
            raise BlobMissingError(f"no blob for page {key.hex()}") from None

    def _read(self, key: PageKey, tenant: str, out: torch.Tensor | None) -> torch.Tensor:
        try:
            return self._blobs.read(key, tenant, out)
        except BlobUnavailableError:
            with self._write_lock:
                self._delete_blobs(self._catalog.drop_pages([PageId(self._namespace, key)]))
            raise

    def _enforce_bound(self, protect: str | None = None) -> Removal:
        with self._write_lock:
            removal = self._catalog.evict_to(self._disk_bytes, protect)
            self._delete_blobs(removal)
            return removal

    def _delete_blobs(self, removal: Removal) -> None:
        for page in removal.pages:
            self._store(page.namespace).delete(page.key)

    def _store(self, namespace: bytes) -> BlobStore:
        store = self._stores.get(namespace)
        if store is None:
            store = self._stores[namespace] = BlobStore(self._root, namespace)
        return store
