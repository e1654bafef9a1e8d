"""Worker side: owns the host page pool and this rank's disk blobs; executes the step's jobs.

RAM loads run synchronously in `start_load_kv` (before the forward that needs them); stores and
persists run in `wait_for_save`, after the forward. Disk loads run on a background thread and
are reported through `get_finished`; a blob that fails verification becomes a load error so
vLLM recomputes those blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.metadata import (
    DiskLoadJob,
    KVCIMetadata,
    KVCIWorkerMetadata,
    PersistJob,
)
from kvci_plugin.connector.pages import page_views, slot_bytes
from kvci_plugin.connector.stats import KVCIStats
from kvci_plugin.ops import scatter_pages
from kvci_plugin.tiering.blob_backend import BlobBackend, BlobRoot, open_blob_root
from kvci_plugin.tiering.blob_codec import BlobUnavailableError
from kvci_plugin.tiering.page_pool import PagePool

logger = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20
"""Bytes of pages a disk load reads before scattering them: a longer prefix is loaded in parts."""

IDLE_WAIT_S = 0.01
"""How long a step with nothing to compute waits for a disk load in flight. While requests wait
only for their loads vLLM steps without pause; each empty step takes the CPU and the GIL from
the load it waits for (a 32 MiB load took 2-4x longer). A new request waits at most this long."""


class KVCIWorker:
    def __init__(
        self,
        *,
        num_slots: int,
        expected_slot_bytes: int,
        num_blocks: int,
        config: KVCIConfig,
        rank_namespace: bytes,
    ) -> None:
        self._num_slots = num_slots
        self._expected_slot_bytes = expected_slot_bytes
        self._num_blocks = num_blocks
        self._config = config
        self._rank_namespace = rank_namespace
        self._views: list[torch.Tensor] = []
        self._pool: PagePool | None = None
        self._blob_root: BlobRoot | None = None
        self._blobs: BlobBackend | None = None
        self._meta: KVCIMetadata | None = None
        self._prev_finished: set[str] = set()
        self._stored: set[str] = set()
        self._disk_loads: dict[str, Future[tuple[set[int], list[bytes]]]] = {}
        self._idle_step = False
        self._staging: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        self._worker_meta = KVCIWorkerMetadata()
        self._stats = KVCIStats()
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvci-disk")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._views = page_views(kv_caches, self._num_blocks)
        got = slot_bytes(self._views)
        if got != self._expected_slot_bytes:
            raise RuntimeError(
                f"kvci: worker page bytes {got} != scheduler's {self._expected_slot_bytes}"
            )
        self._pool = PagePool(self._num_slots, got)
        if self._config.disk_tier:
            self._blob_root = open_blob_root(self._config.blob_url, self._config.disk_root)
            self._blobs = self._blob_root.store(self._rank_namespace)

    def bind(self, meta: KVCIMetadata) -> None:
        self._meta = meta

    def clear(self) -> None:
        self._meta = None

    def start_load_kv(self, *, forward: bool) -> None:
        """Start this step's loads; ``forward`` is False when vLLM steps without computing."""
        self._idle_step = not forward
        meta = self._meta
        if meta is None or self._pool is None:
            return
        for job in meta.loads:
            t0 = time.perf_counter()
            self._pool.load(job.slots, self._views, job.block_ids)
            self._stats.observe_load("ram", len(job.slots) * self._pool.slot_bytes,
                                     time.perf_counter() - t0)
        for job in meta.disk_loads:
            self._disk_loads[job.req_id] = self._io.submit(self._load_from_disk, job)

    def _load_from_disk(self, job: DiskLoadJob) -> tuple[set[int], list[bytes]]:
        """Returns the block ids that failed and the bad page; the rest are in the paged cache.

        The blobs are read and verified several at a time into the staging buffer, a buffer-full
        at a time, and each run of pages that verified (a leading run: KV is a prefix) is
        scattered in one call.
        """
        assert self._blobs is not None and self._pool is not None
        t0 = time.perf_counter()
        staging = self._staging_buffer()
        loaded, error = 0, None
        while loaded < len(job.keys) and error is None:
            chunk = job.keys[loaded : loaded + len(staging)]
            try:
                verified, error = self._blobs.read_many(chunk, job.tenant, staging)
            except Exception as exc:  # the store itself failed (e.g. Redis unreachable): a miss
                verified, error = 0, exc
            if verified:
                scatter_pages(staging, torch.arange(verified, dtype=torch.int64), self._views,
                              torch.tensor(job.block_ids[loaded : loaded + verified],
                                           dtype=torch.int64))
            loaded += verified
        failed: set[int] = set()
        bad: list[bytes] = []
        if error is not None:
            logger.warning("kvci: disk load failed (%s: %s); recomputing",
                           type(error).__name__, error)
            failed.update(job.block_ids[loaded:])  # later blocks depend on this prefix
            if isinstance(error, BlobUnavailableError):
                bad.append(job.keys[loaded])  # missing or corrupt: the catalog forgets it
        self._stats.observe_load("disk", loaded * self._pool.slot_bytes, time.perf_counter() - t0)
        return failed, bad

    def _staging_buffer(self) -> torch.Tensor:
        """The disk loads' staging pages, made once: only the one I/O thread uses it, and a fresh
        buffer per load spent a quarter of the load's time faulting its memory in. Pinned like
        the RAM pool (when CUDA is there): a copy to the GPU needs page-locked host memory."""
        assert self._pool is not None
        if self._staging is None:
            pages = max(1, STAGING_BYTES // self._pool.slot_bytes)
            self._staging = torch.empty((pages, self._pool.slot_bytes), dtype=torch.uint8,
                                        pin_memory=self._pool.pinned)
        return self._staging

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or self._pool is None:
            return
        for job in meta.stores:
            t0 = time.perf_counter()
            self._pool.store(self._views, job.block_ids, job.slots)
            self._stats.observe_store("ram", len(job.slots) * self._pool.slot_bytes,
                                      time.perf_counter() - t0)
            self._stored.add(job.req_id)
        for pjob in meta.persists:
            self._persist(pjob)

    def _persist(self, job: PersistJob) -> None:
        if self._blobs is None or self._pool is None:
            self._worker_meta.persist_errors.setdefault(job.checkpoint_id, []).append(
                "no disk tier on this worker")
            return
        t0 = time.perf_counter()
        try:
            # Several blobs at once: their fsyncs overlap, and this runs in the engine's step.
            written = sum(self._blobs.write_many(job.keys, job.tenant,
                                                 self._pool.read_many(job.slots)))
        except Exception as exc:  # reported to the scheduler, which records no catalog row
            logger.warning("kvci: persist of %s failed: %s: %s", job.checkpoint_id,
                           type(exc).__name__, exc)
            self._worker_meta.persist_errors.setdefault(job.checkpoint_id, []).append(
                f"{type(exc).__name__}: {exc}")
            return
        self._stats.observe_store("disk", written, time.perf_counter() - t0)
        self._worker_meta.persisted[job.checkpoint_id] = 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # A store job and its request's finished id arrive in the same step; keep the previous
        # step's ids too in case async scheduling splits them.
        sending = self._stored & (finished_req_ids | self._prev_finished)
        self._stored -= sending
        self._prev_finished = set(finished_req_ids)
        recving: set[str] = set()
        if self._idle_step and self._disk_loads:
            wait(self._disk_loads.values(), timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        for req_id, fut in list(self._disk_loads.items()):
            if fut.done():
                failed, bad = fut.result()
                self._load_errors |= failed
                self._worker_meta.bad_pages.extend(bad)
                recving.add(req_id)
                del self._disk_loads[req_id]
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KVCIWorkerMetadata | None:
        meta, self._worker_meta = self._worker_meta, KVCIWorkerMetadata()
        return meta if (meta.persisted or meta.persist_errors or meta.bad_pages) else None

    def take_stats(self) -> KVCIStats | None:
        stats, self._stats = self._stats, KVCIStats()
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        if self._blob_root is not None:
            self._blob_root.close()
