"""Worker side: owns the host page pool and this rank's disk blobs; executes the step's jobs.

RAM loads are queued in `start_load_kv`, before the forward that reads them; RAM stores and
persists in `wait_for_save`, after the forward that wrote the pages. With the KV cache on a GPU,
the copies run on side CUDA streams (`PageCopyStream`; loads, stores and disk loads apart): the
forward waits for a load on the GPU, a store overlaps the following steps and its request is
reported finished (so vLLM frees its blocks) only once the copy has run. On the CPU a RAM load
is copied a layer at a time beside the forward, each in place by the time the forward reaches
it (`LayerwiseLoads`), and every other copy is done before its call returns.
Disk loads run on a background thread and are reported through `get_finished`, but for one the
step's forward reads (the request is the only one) while that thread is idle: it is read in
`start_load_kv` itself. A blob that fails verification becomes a load error so vLLM recomputes
those blocks.

Imports torch alone (no vllm), so it is exercised on a GPU machine without vLLM.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import torch

from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.jobs import (
    DiskLoadJob,
    FailedLoad,
    PersistJob,
    StepJobs,
    StoreJob,
    WorkerReport,
    by_group,
)
from kvci_plugin.connector.layer_loads import LayerPart, LayerSource, LayerwiseLoads
from kvci_plugin.connector.pages import page_views, slot_bytes
from kvci_plugin.connector.tally import StatsTally
from kvci_plugin.connector.window_copies import WindowCopies
from kvci_plugin.ops import PageCopyStream, PendingCopy, scatter_pages
from kvci_plugin.ops.affinity import on_any_core
from kvci_plugin.tiering.blobs.backend import BlobBackend, BlobRoot
from kvci_plugin.tiering.blobs.errors import BlobUnavailableError
from kvci_plugin.tiering.health import fault_kind
from kvci_plugin.tiering.keys import generation_namespace
from kvci_plugin.tiering.ram.pool import PagePool
from kvci_plugin.tiering.types import TenantMismatchError

logger = logging.getLogger(__name__)

_RELEASED = -1
"""The generation of a disk load in flight when the KV cache was released: it never matches, so
the load is reported failed."""

STAGING_BYTES = 64 << 20
"""Bytes of pages a disk load reads before scattering them: a longer prefix is loaded in parts."""

IDLE_WAIT_S = 0.05
"""How long a step with nothing to compute waits for a disk load in flight to end. While requests
wait only for their loads vLLM steps without pause; each empty step takes the CPU and the GIL
from the load it waits for (a load took several times longer), and a load that ends just after
its step's wait is seen a whole step later. Long enough for a prefix of tens of MiB from the
page cache to be reported in the step that started it; a request arriving while nothing
computes waits at most this long."""


@dataclass
class _DiskLoadResult:
    failed: set[int] = field(default_factory=set)  # block ids vLLM must recompute
    bad: list[bytes] = field(
        default_factory=list
    )  # missing or corrupt page: the catalog forgets it
    nbytes: int = 0
    seconds: float = 0.0
    read_s: float = 0.0  # reading and verifying the blobs
    scatter_s: float = 0.0  # copying the verified pages into the paged cache
    # Verified pages left in the staging buffer, copied in a layer at a time by the forward.
    staged: list[LayerSource] = field(default_factory=list)
    fault: str | None = None  # "kind: error" when the blob store itself failed (not a bad blob)


class KVCIWorker:
    def __init__(
        self,
        *,
        num_slots: int,
        expected_slot_bytes: int,
        num_blocks: int,
        rank_namespace: bytes,
        blob_root: BlobRoot | None,
        group_layers: list[list[str]] | None = None,
    ) -> None:
        """``blob_root``: the disk tier's blobs (this worker closes it), None without one.
        ``group_layers``: the layers of each KV cache group (a slot is one group's pages of one
        block); None: one group of every layer."""
        self._num_slots = num_slots
        self._expected_slot_bytes = expected_slot_bytes
        self._num_blocks = num_blocks
        self._group_layers = group_layers
        self._views: list[list[torch.Tensor]] = []  # per group: its layers' page views
        self._pool: PagePool | None = None
        self._load_copies: PageCopyStream | None = None
        self._store_copies: PageCopyStream | None = None
        self._disk_copies: PageCopyStream | None = None
        self._blob_root = blob_root
        self._rank_namespace = rank_namespace
        self._generation = 0  # the scheduler's, from each step's jobs: a cache reset moves it
        self._blobs: BlobBackend | None = (
            blob_root.store(rank_namespace) if blob_root is not None else None)
        self._meta: StepJobs | None = None
        self._prev_finished: set[str] = set()
        self._saves: dict[str, PendingCopy] = {}  # store copies not yet reported, by request
        self._timed: list[tuple[str, PendingCopy]] = []  # ("load" | "store", RAM copy) to count
        # Disk loads in flight: the read, its job and the generation it was planned in.
        self._disk_loads: dict[str, tuple[Future[_DiskLoadResult], DiskLoadJob, int]] = {}
        self._idle_step = False
        self._staging: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        self._report = WorkerReport()
        self._stats = StatsTally()
        # Failures contained in the hooks, counted in whichever stats are current.
        self.contain = Containment(lambda name: self._stats.count(name))
        self._windows = WindowCopies(self.contain)  # running requests' window pages
        self._failed_recving: set[str] = set()  # async loads that failed before they started
        # Async loads failed as a whole: vLLM recomputes their requests from the start. With
        # several KV cache groups (a hybrid model) vLLM refuses block-level load errors, so an
        # async load of one fails this way (and its blocks are not reported).
        self._recv_failed: set[str] = set()
        self._hybrid = group_layers is not None and len(group_layers) > 1
        self._failed_saves: set[str] = set()  # stores that failed: reported finished, not kept
        self._io: ThreadPoolExecutor | None = None
        self._asleep = False  # sleep mode: the KV cache memory is released
        # The newest generation whose KV the last release of the KV cache may have outlived
        # (weights updated meanwhile): its jobs and older ones are refused (``_fenced``).
        self._fenced_through: int | None = None
        self._bound = False  # a step's jobs have reached this worker: its generation is known
        # Released before any step: the generation of the first step's jobs is fenced.
        self._fence_first_seen = False
        self._layer_loads: LayerwiseLoads | None = None  # the CPU's RAM loads

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = self._group_layers or [list(kv_caches)]
        per_layer = {name: page_views({name: t}, self._num_blocks) for name, t in kv_caches.items()}
        self._views = [[v for name in names for v in per_layer[name]] for names in groups]
        for views in self._views:
            got = slot_bytes(views)
            if got != self._expected_slot_bytes:
                raise RuntimeError(
                    f"kvci: worker page bytes {got} != scheduler's {self._expected_slot_bytes}")
        self._pool = PagePool(self._num_slots, self._expected_slot_bytes)
        device = self._views[0][0].device
        if device.type == "cpu":
            parts = []
            for g, names in enumerate(groups):
                offset = 0
                for name in names:
                    parts.append(LayerPart(name, g, offset, per_layer[name]))
                    offset += slot_bytes(per_layer[name])
            # Layer by layer as the forward reaches each; on CUDA the load stream overlaps it.
            self._layer_loads = LayerwiseLoads(parts)
        # A stream each, so that a load never queues behind a store: a slot becomes loadable only
        # once every worker reported its store done, and a slot a load reads is reused only by a
        # store queued after the forward that waited for that load.
        self._load_copies, self._store_copies, self._disk_copies = (
            PageCopyStream(device), PageCopyStream(device), PageCopyStream(device))
        # A new thread starts on GPU 0: on another rank's GPU its stream switches would open a
        # context on GPU 0, so the I/O thread starts on this worker's device. On the CPU it may
        # run on any core, not only the forward's.
        self._io = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvci-disk",
            initializer=torch.cuda.set_device if device.type == "cuda" else on_any_core,
            initargs=(device,) if device.type == "cuda" else ())
        if self._blob_root is not None:
            # Faulted in now, at engine start: made at the first disk load, its first touch cost
            # that hit most of its reading and verifying, many times a later hit's whole read and
            # verify.
            self._staging_buffer().zero_()

    def unregister_kv_caches(self) -> None:
        """The KV cache memory is about to be released: for a sleep (vLLM 0.33), or lent out
        during a layer-wise weight update (0.34's extensible KV cache). Every copy in flight runs
        to its end first, and no job touches the cache until ``restore_kv_caches``. A disk load
        in flight is reported failed: the blocks it filled lose their memory (vLLM recomputes
        them). The weights may change before the restore, with or without a cache reset
        (``reset_connector=False``), so the KV of every generation this worker has seen is
        fenced as a reset fences it (``restore_kv_caches``)."""
        for fut, _, _ in self._disk_loads.values():
            fut.exception()  # waits for the read to end
        self._disk_loads = {req_id: (fut, job, _RELEASED)
                            for req_id, (fut, job, _) in self._disk_loads.items()}
        self._finish_layer_loads()
        for copies in (self._load_copies, self._store_copies, self._disk_copies):
            if copies is not None:
                copies.drain()
        self._asleep = True
        if self._bound:
            self._fenced_through = max(self._generation, self._fenced_through or 0)
        else:  # the scheduler's generation is not known here yet: the first one told is fenced
            self._fence_first_seen = True

    def restore_kv_caches(self) -> None:
        """The KV cache is mapped again at the addresses the page views name (its pages are new:
        the views, the pool and the staging buffer stay valid). Nothing from before comes back:
        loads and persists of a generation up to the fenced one are refused (recomputed; not
        written), and the scheduler is told to reset unless it has already, so only KV
        computed after the restore is loaded again."""
        self._asleep = False
        if self._fenced_through is not None:
            self._report.fence_generation = self._fenced_through

    def _fenced(self, meta: StepJobs) -> StepJobs:
        """``meta`` less what the last release fenced: its loads fail (recomputed) and its
        persists are refused, until the scheduler's jobs come in a newer generation (its reset).
        Stores still run: they copy KV computed after the restore, and free their blocks."""
        if not (meta.loads or meta.disk_loads or meta.persists or meta.window_stores):
            return meta
        # A window's earlier blocks may predate the release: never made loadable.
        self._report.window_failed.extend(job.checkpoint_id for job in meta.window_stores)
        failed = [FailedLoad(job.req_id, job.block_ids, False) for job in meta.loads]
        failed += [FailedLoad(job.req_id, job.block_ids, not job.sync) for job in meta.disk_loads]
        for pjob in meta.persists:
            self._report.persist_errors.setdefault(pjob.checkpoint_id, []).append(
                "fenced: the KV cache was released and restored (a sleep or a weight update) "
                "and kvci's tiers are being reset")
        self._report.fence_generation = self._fenced_through  # the scheduler resets (again)
        return replace(meta, loads=[], disk_loads=[], persists=[], window_stores=[],
                       failed_loads=[*meta.failed_loads, *failed])

    def bind(self, meta: StepJobs) -> None:
        if self._asleep and (meta.loads or meta.disk_loads or meta.stores or meta.persists
                             or meta.window_stores):
            raise RuntimeError("kvci: copy jobs reached a worker whose KV cache is released "
                               "(asleep): vLLM must wake it first")
        self._bound = True
        if self._fence_first_seen:
            self._fence_first_seen = False
            self._fenced_through = max(meta.generation, self._fenced_through or 0)
            self._report.fence_generation = self._fenced_through
        if self._fenced_through is not None and meta.generation <= self._fenced_through:
            meta = self._fenced(meta)
        self._meta = meta
        if meta.generation != self._generation:
            self._enter_generation(meta.generation)

    def _enter_generation(self, generation: int) -> None:
        """A cache reset: this rank's blobs are keyed in the new generation's namespace; a disk
        load still in flight is reported failed (its KV predates the reset: recomputed)."""
        self._generation = generation
        if self._blob_root is not None:
            self._blobs = self._blob_root.store(
                generation_namespace(self._rank_namespace, generation))

    def clear(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Start this step's loads (before the forward that reads them). A failure fails the
        step's loads that are not under way: vLLM recomputes their blocks."""
        meta = self._meta
        self._idle_step = meta is None or not meta.forward
        if meta is not None and meta.failed_loads:
            self._fail_loads(meta.failed_loads)
        if meta is None or not (meta.loads or meta.disk_loads):
            return  # most steps: nothing to load
        try:
            self._start_loads(meta)
        except Exception as exc:
            self.contain.fault("starting loads", exc)
            assert meta is not None  # nothing to start without one
            self._fail_loads([FailedLoad(job.req_id, job.block_ids, False) for job in meta.loads])
            self._fail_loads([FailedLoad(job.req_id, job.block_ids, not job.sync)
                              for job in meta.disk_loads if job.req_id not in self._disk_loads])

    def _fail_loads(self, failed: list[FailedLoad]) -> None:
        """These loads' blocks are recomputed; an asynchronous one is reported finished."""
        for load in failed:
            if load.asynchronous:
                self._failed_recving.add(load.req_id)
            self._fail_blocks(load.req_id, load.block_ids, load.asynchronous)

    def _fail_blocks(
        self, req_id: str, block_ids: list[int] | set[int], asynchronous: bool
    ) -> None:
        self._report.failed_loads.append(req_id)
        if asynchronous and self._hybrid:
            self._recv_failed.add(req_id)
        else:
            self._load_errors.update(block_ids)

    def take_failed_recving(self) -> set[str] | None:
        """Async loads failed as a whole since the last call (vLLM's ``failed_recving``); None
        when there were none (most steps)."""
        if not self._recv_failed:
            return None
        failed, self._recv_failed = self._recv_failed, set()
        return failed

    def _start_loads(self, meta: StepJobs) -> None:
        if self._pool is None or self._load_copies is None:
            return
        pool, views = self._pool, self._views
        layered = [LayerSource(g, pool.pages, slots, blocks) for job in meta.loads
                   for g, slots, blocks in by_group(job.slots, job.block_ids, job.groups)]
        if self._layer_loads is None:
            for job in meta.loads:
                pending = self._load_copies.run(
                    lambda job=job: [pool.load(slots, views[g], blocks)
                                     for g, slots, blocks in by_group(job.slots, job.block_ids,
                                                                      job.groups)],
                    len(job.slots) * pool.slot_bytes)
                self._load_copies.hold(pending)  # this step's forward reads the pages
                self._timed.append(("load", pending))
        if meta.disk_loads:
            assert self._disk_copies is not None
            # Work queued before this step may still use the blocks (a freed block's last
            # reader or writer): the I/O thread's scatters wait for this point.
            assert self._io is not None
            fence = self._disk_copies.fence()
            for djob in meta.disk_loads:
                if djob.sync and not self._disk_loads:
                    # This step's forward reads the pages and the I/O thread is idle: read them
                    # here. Handed to the I/O thread and waited for, the same load took longer
                    # and so did the forward after it (``benchmarks/ttft.py``, the disk hits).
                    # On the CPU they are copied in layer by layer, as a RAM load's,
                    # from the staging buffer, which no other load uses before the step ends.
                    stage = (self._layer_loads is not None and len(meta.disk_loads) == 1
                             and len(djob.keys) <= len(self._staging_buffer()))
                    result = self._load_from_disk(djob, self._blobs, fence, stage=stage)
                    layered += result.staged
                    self._disk_load_done(result, djob, self._generation)
                    continue
                read = self._io.submit(self._load_from_disk, djob, self._blobs, fence)
                if djob.sync:  # behind the I/O thread's loads, which use its staging buffer
                    self._disk_load_done(read.result(), djob, self._generation)
                else:
                    self._disk_loads[djob.req_id] = (read, djob, self._generation)
        if self._layer_loads is not None and layered:
            self._layer_loads.start(
                layered, sum(len(job.slots) for job in meta.loads) * pool.slot_bytes
            )

    def _load_from_disk(self, job: DiskLoadJob, blobs: BlobBackend | None,
                        fence: torch.cuda.Event | None, stage: bool = False) -> _DiskLoadResult:
        """Returns the block ids that failed and the bad page; the rest are in the paged cache,
        or with ``stage`` (a prefix that fits the staging buffer) left there as ``staged``.

        The blobs are read and verified several at a time into the staging buffer, a buffer-full
        at a time, and each run of pages that verified (a leading run: KV is a prefix) is
        scattered in one call, waited for before the buffer is refilled or the load reported.
        """
        assert blobs is not None and self._pool is not None
        assert self._disk_copies is not None
        t0 = time.perf_counter()
        staging = self._staging_buffer()
        loaded, error = 0, None
        read_s = scatter_s = 0.0
        staged: list[LayerSource] = []
        while loaded < len(job.keys) and error is None:
            chunk = job.keys[loaded : loaded + len(staging)]
            t_read = time.perf_counter()
            try:
                verified, error = blobs.read_many(chunk, job.tenant, staging)
            except Exception as exc:  # the store itself failed (e.g. Redis unreachable): a miss
                verified, error = 0, exc
            t_scatter = time.perf_counter()
            read_s += t_scatter - t_read
            parts = by_group(list(range(verified)), job.block_ids[loaded : loaded + verified],
                             job.groups[loaded : loaded + verified]) if verified else []
            if stage:  # one buffer-full: the caller checked it fits
                staged = [LayerSource(g, staging, slots, blocks) for g, slots, blocks in parts]
            elif parts:
                self._disk_copies.run(
                    lambda parts=parts: [scatter_pages(
                        staging, torch.tensor(slots, dtype=torch.int64), self._views[g],
                        torch.tensor(blocks, dtype=torch.int64)) for g, slots, blocks in parts],
                    verified * self._pool.slot_bytes, after=fence).wait()
            scatter_s += time.perf_counter() - t_scatter
            loaded += verified
        result = _DiskLoadResult(nbytes=loaded * self._pool.slot_bytes, read_s=read_s,
                                 scatter_s=scatter_s, staged=staged)
        if error is not None:
            logger.warning("kvci: disk load failed (%s: %s); recomputing",
                           type(error).__name__, error)
            result.failed.update(job.block_ids[loaded:])  # later blocks depend on this prefix
            if isinstance(error, BlobUnavailableError):
                result.bad.append(job.keys[loaded])
            elif not isinstance(error, TenantMismatchError):  # the store failed, not the blob
                result.fault = f"{fault_kind(error)}: {type(error).__name__}: {error}"
        result.seconds = time.perf_counter() - t0
        return result

    def _staging_buffer(self) -> torch.Tensor:
        """The disk loads' staging pages, made once (with the KV caches, when a disk tier is
        there): one load at a time uses it (on the I/O thread, or on the step's own while that
        thread is idle), and a fresh buffer per load spent a quarter of the load's time
        faulting its memory in. Pinned like
        the RAM pool (when CUDA is there): a copy to the GPU needs page-locked host memory."""
        assert self._pool is not None
        if self._staging is None:
            pages = max(1, STAGING_BYTES // self._pool.slot_bytes)
            self._staging = torch.empty((pages, self._pool.slot_bytes), dtype=torch.uint8,
                                        pin_memory=self._pool.pinned)
        return self._staging

    @property
    def layers_loading(self) -> bool:
        """Whether a started load's layers may still be copied in (else ``wait_for_layer_load``
        does nothing): a step without a forward has no ``wait_for_save`` to finish its own."""
        return self._layer_loads is not None and self._layer_loads.started

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_loads is not None:
            try:
                self._layer_loads.wait(layer_name)
            except Exception as exc:  # this step's RAM loads may be partial: recomputed
                self.contain.fault("loading a layer", exc)
                if self._meta is not None:
                    self._fail_loads([FailedLoad(job.req_id, job.block_ids, False)
                                      for job in self._meta.loads])

    def _finish_layer_loads(self) -> None:
        """Every page of this step's RAM loads is in (the forward has ended, or there was none)."""
        if self._layer_loads is not None:
            done = self._layer_loads.finish()
            if done is not None and done.nbytes:  # a staged disk load is counted as a disk load
                self._timed.append(("load", done))

    def wait_for_save(self) -> None:
        try:
            self._finish_layer_loads()
        except Exception as exc:
            self.contain.fault("loading a layer", exc)
            if self._meta is not None:
                self._fail_loads([FailedLoad(job.req_id, job.block_ids, False)
                                  for job in self._meta.loads])
        meta = self._meta
        if meta is None or self._pool is None or self._store_copies is None:
            return
        if meta.window_stores:  # those that ran are reported with the step (take_report)
            self._windows.start(meta.window_stores, self._copy_out, self._store_copies.hold,
                                self._report, self._timed)
        for job in meta.stores:
            try:
                pending = self._copy_out(job)
            except Exception as exc:  # not kept; its blocks are still freed once reported
                self.contain.fault("storing pages", exc)
                self._failed_saves.add(job.req_id)
                self._report.failed_stores.append(job.req_id)
                continue
            self._saves[job.req_id] = pending
            self._timed.append(("store", pending))
        if meta.persists:
            try:
                self._store_copies.drain()  # a persist reads on the host the slots just stored
            except Exception as exc:
                self.contain.fault("storing pages", exc)
                for pjob in meta.persists:
                    self._report.persist_errors.setdefault(pjob.checkpoint_id, []).append(
                        f"the RAM copy failed: {type(exc).__name__}: {exc}")
                return
        for pjob in meta.persists:
            self._persist(pjob)

    def _copy_out(self, job: StoreJob) -> PendingCopy:
        """Queue the copy of ``job``'s blocks into its pool slots on the store stream."""
        assert self._pool is not None and self._store_copies is not None
        pool, views = self._pool, self._views
        return self._store_copies.run(
            lambda: [pool.store(views[g], blocks, slots)
                     for g, slots, blocks in by_group(job.slots, job.block_ids, job.groups)],
            len(job.slots) * pool.slot_bytes)

    def _persist(self, job: PersistJob) -> None:
        if self._blobs is None or self._pool is None:
            self._report.persist_errors.setdefault(job.checkpoint_id, []).append(
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
            self._report.persist_errors.setdefault(job.checkpoint_id, []).append(
                f"{type(exc).__name__}: {exc}")
            kind = fault_kind(exc)
            if kind != "internal":  # the blob store failed: the tier is skipped until it answers
                self._stats.count(f"faults_disk_{kind}")
                self._report.disk_faults.append(f"{kind}: {type(exc).__name__}: {exc}")
            return
        self._stats.observe_store("disk", written, time.perf_counter() - t0)
        self._report.persisted[job.checkpoint_id] = 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # A store job and its request's finished id arrive in the same step; keep the previous
        # step's ids too in case async scheduling splits them. A store is reported (and vLLM
        # frees the blocks it reads) only once its copy has run.
        if not (self._saves or self._disk_loads or self._failed_saves or self._failed_recving):
            self._prev_finished = set(finished_req_ids)
            return None, None  # most steps: nothing in flight
        sending: set[str] = set()
        if self._saves or self._failed_saves:
            sending = {req_id for req_id in finished_req_ids | self._prev_finished
                       if req_id in self._failed_saves
                       or (req_id in self._saves and self._copy_ended(self._saves[req_id]))}
            for req_id in sending:
                self._saves.pop(req_id, None)
                self._failed_saves.discard(req_id)
        self._prev_finished = set(finished_req_ids) | (
            self._prev_finished & (self._saves.keys() | self._failed_saves))
        recving, self._failed_recving = self._failed_recving, set()
        if self._idle_step and self._disk_loads:
            wait([fut for fut, _, _ in self._disk_loads.values()], timeout=IDLE_WAIT_S,
                 return_when=FIRST_COMPLETED)
        for req_id, (fut, job, generation) in list(self._disk_loads.items()):
            if fut.done():
                try:
                    result = fut.result()
                except Exception as exc:  # the read itself broke: the whole load is recomputed
                    self.contain.fault("a disk load", exc, tier="disk")
                    result = _DiskLoadResult(failed=set(job.block_ids))
                self._disk_load_done(result, job, generation)
                recving.add(req_id)
                del self._disk_loads[req_id]
        return (sending or None), (recving or None)

    def _copy_ended(self, pending: PendingCopy) -> bool:
        """Whether a store's copy has ended; one that failed is reported, never kept."""
        try:
            return pending.done()
        except Exception as exc:
            self.contain.fault("storing pages", exc)
            for req_id, other in self._saves.items():
                if other is pending:
                    self._report.failed_stores.append(req_id)
            return True

    def _disk_load_done(self, result: _DiskLoadResult, job: DiskLoadJob, generation: int) -> None:
        """A disk load has ended: its failed blocks, bad pages and times go to vLLM and the
        scheduler."""
        if generation != self._generation:
            result = _DiskLoadResult(failed=set(job.block_ids))  # fenced by a reset
        if result.failed:
            self._fail_blocks(job.req_id, result.failed, not job.sync)
        self._report.bad_pages.extend(result.bad)
        if result.fault is not None:
            self._stats.count(f"faults_disk_{result.fault.split(':', 1)[0]}")
            self._report.disk_faults.append(result.fault)
        self._stats.observe_load("disk", result.nbytes, result.seconds)
        self._stats.observe_phase("disk_read", result.read_s)
        if not result.staged:  # else the forward copies the pages in, within its own time
            self._stats.observe_phase("disk_scatter", result.scatter_s)
        if result.nbytes:
            self._report.disk_loads.append((result.nbytes, result.seconds))

    def _count_done_copies(self) -> None:
        """Count the RAM copies that have run (on CUDA their times are known only then)."""
        still: list[tuple[str, PendingCopy]] = []
        for kind, pending in self._timed:
            if not pending.done():
                still.append((kind, pending))
            elif kind == "load":
                self._stats.observe_load("ram", pending.nbytes, pending.seconds())
            else:
                self._stats.observe_store("ram", pending.nbytes, pending.seconds())
        self._timed = still

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        self._windows.finish(self._report)
        if self._report.is_empty():
            return None
        report, self._report = self._report, WorkerReport()
        return report

    def take_stats(self) -> StatsTally | None:
        if self._timed:
            self._count_done_copies()
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, StatsTally()
        return stats

    def shutdown(self) -> None:
        if self._layer_loads is not None:
            self._layer_loads.shutdown()
        if self._io is not None:
            self._io.shutdown(wait=True)
        for copies in (self._load_copies, self._store_copies, self._disk_copies):
            if copies is not None:
                copies.drain()
        if self._blob_root is not None:
            self._blob_root.close()
