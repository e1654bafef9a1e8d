"""A step's copy jobs and the worker's report on them: plain dataclasses, no vllm.

`metadata.py` wraps them in vLLM's metadata classes; the worker uses them as they are, so it runs
(and is tested on a GPU machine) with torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadJob:
    """Copy RAM pool slots into the request's paged-cache blocks (before the forward)."""

    req_id: str
    slots: list[int]
    block_ids: list[int]
    groups: list[int] = field(default_factory=list)  # each page's KV cache group; []: all group 0


@dataclass(frozen=True)
class DiskLoadJob:
    """Read verified disk blobs into the request's blocks: on steps of their own (the request
    waits, others run), or, when ``sync``, before the forward of the step that plans it."""

    req_id: str
    tenant: str
    keys: list[bytes]
    block_ids: list[int]
    groups: list[int] = field(default_factory=list)
    sync: bool = False


@dataclass(frozen=True)
class StoreJob:
    """Copy a finished request's blocks into RAM pool slots (its blocks are held until done)."""

    req_id: str
    checkpoint_id: str
    slots: list[int]
    block_ids: list[int]
    groups: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PersistJob:
    """Write RAM pool slots to this rank's disk blobs; the scheduler records the catalog row
    only after every rank reported its shard durable."""

    checkpoint_id: str
    tenant: str
    keys: list[bytes]
    slots: list[int]


@dataclass(frozen=True)
class FailedLoad:
    """A load the scheduler promised vLLM and could not plan (a contained fault): the worker
    reports its blocks as load errors, so vLLM recomputes them, and an asynchronous one as
    finished, so its request does not wait for it forever."""

    req_id: str
    block_ids: list[int]
    asynchronous: bool


@dataclass
class StepJobs:
    """What one engine step asks of every worker."""

    loads: list[LoadJob] = field(default_factory=list)
    disk_loads: list[DiskLoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    persists: list[PersistJob] = field(default_factory=list)
    failed_loads: list[FailedLoad] = field(default_factory=list)
    # Sliding-window pages of running requests, copied at a prefill boundary (``checkpoint_id``
    # is the window stage's): the next step's writes wait for the copy, and the request's blocks
    # are never reported finished for it (it goes on running).
    window_stores: list[StoreJob] = field(default_factory=list)
    # The generation of the keys: a cache reset moves it, and the workers' blobs with it.
    generation: int = 0
    # Whether this step computes anything: the scheduler knows, on every vLLM version (the
    # forward context cannot say: model runner V2 loads under an empty one).
    forward: bool = True


@dataclass
class WorkerReport:
    """Per-step outcome of persist jobs (summed over ranks) and of disk loads."""

    persisted: dict[str, int] = field(default_factory=dict)
    persist_errors: dict[str, list[str]] = field(default_factory=dict)
    # Disk pages a load found missing or corrupt: the scheduler forgets them.
    bad_pages: list[bytes] = field(default_factory=list)
    # (bytes, seconds) of each disk load this rank finished: the scheduler's LoadOrRecompute.
    disk_loads: list[tuple[int, float]] = field(default_factory=list)
    # Requests whose RAM store failed on this rank: reported finished (vLLM frees their blocks)
    # and never made loadable.
    failed_stores: list[str] = field(default_factory=list)
    # "kind: error" of each time the disk tier's blob store failed this rank (not a bad blob):
    # the scheduler marks the tier degraded.
    disk_faults: list[str] = field(default_factory=list)
    # Requests whose load failed on this rank (in any part): vLLM recomputes the blocks, and
    # the reply reports no hit.
    failed_loads: list[str] = field(default_factory=list)
    # The KV cache was released and restored (sleep, or a weight update borrowing its memory):
    # the KV of this generation and older may predate new weights, and this rank refuses its
    # jobs; the scheduler resets (fences its tiers) unless it is past this generation already.
    fence_generation: int | None = None
    # Window stages (``StepJobs.window_stores``) whose copy ran on this rank, and those that
    # failed on it: a stage is committed once every rank copied it, dropped if any failed.
    window_stored: dict[str, int] = field(default_factory=dict)
    window_failed: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.persisted or self.persist_errors or self.bad_pages or self.disk_loads
                    or self.failed_stores or self.disk_faults or self.failed_loads
                    or self.fence_generation is not None or self.window_stored
                    or self.window_failed)

    def merged(self, other: WorkerReport) -> WorkerReport:
        """This report and ``other`` (another rank's) summed."""
        persisted = dict(self.persisted)
        for cid, n in other.persisted.items():
            persisted[cid] = persisted.get(cid, 0) + n
        errors = {cid: list(errs) for cid, errs in self.persist_errors.items()}
        for cid, errs in other.persist_errors.items():
            errors.setdefault(cid, []).extend(errs)
        window = dict(self.window_stored)
        for sid, n in other.window_stored.items():
            window[sid] = window.get(sid, 0) + n
        return WorkerReport(persisted, errors, self.bad_pages + other.bad_pages,
                            self.disk_loads + other.disk_loads,
                            self.failed_stores + other.failed_stores,
                            self.disk_faults + other.disk_faults,
                            self.failed_loads + other.failed_loads,
                            max((g for g in (self.fence_generation, other.fence_generation)
                                 if g is not None), default=None),
                            window, self.window_failed + other.window_failed)


def by_group(slots: list[int], block_ids: list[int],
             groups: list[int]) -> list[tuple[int, list[int], list[int]]]:
    """(group, slots, block ids) of a job's pages, one entry per KV cache group it names."""
    if not groups:
        return [(0, slots, block_ids)]
    out: dict[int, tuple[list[int], list[int]]] = {}
    for slot, block, g in zip(slots, block_ids, groups, strict=True):
        s, b = out.setdefault(g, ([], []))
        s.append(slot)
        b.append(block)
    return [(g, s, b) for g, (s, b) in sorted(out.items())]
