"""Many blobs at once: the process's blob thread pools, and the prefix read and the writes that
every backend runs on them (``BlobBackend.read_many`` / ``write_many``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from kvci_plugin.ops.affinity import on_any_core
from kvci_plugin.tiering.blobs.backend import BlobBackend
from kvci_plugin.tiering.blobs.errors import BlobUnavailableError
from kvci_plugin.tiering.blobs.tenant_keys import PageSeal, TenantKeyUnavailableError
from kvci_plugin.tiering.types import PageKey, TenantMismatchError

WRITE_THREADS = 8
"""Blobs ``write_many`` writes at once: fsyncs of separate files overlap in the device queue and
the file system journal (3x the throughput of one at a time on ext4 here)."""

READ_THREADS = 4
"""Blobs a prefix load reads and opens at most at once (never more than the host has cores): the
reads and AES-GCM release the GIL, so a prefix of large pages is bound by the disk and the
cipher, not by one thread's latency."""

MIN_RUN_BYTES = 4 << 20
"""The least a read thread is handed: about a millisecond of reading and opening."""

MIN_THREADED_PAGE_BYTES = 1 << 20
"""The smallest page read on several threads. A smaller page's blob is mostly per-blob Python
and system calls, which hold the GIL: threads then spend more handing it over than they read
in parallel. ``benchmarks/bench_tiers.py`` on 2 cores, 32 MiB: 256 KiB pages read at 2.5 GB/s on
one thread and 2.0 GB/s on two; 1 MiB pages at 3.2 GB/s on one and 5.0 GB/s on two."""


def read_prefix(
    store: BlobBackend, keys: Sequence[PageKey], tenant: str, out: torch.Tensor
) -> tuple[int, BlobUnavailableError | TenantMismatchError | None]:
    """Read ``keys[i]`` into ``out[i]`` several at a time; (pages verified, first failure): the
    prefix read of a backend whose reads are a request each (Redis). A folder reads its files a
    chunk ahead instead (``read_ahead``).

    Only the leading run of pages that verified counts: a page after a failed one is of no use
    (KV is a prefix). ``out`` rows past the returned count hold nothing meaningful. The tenant's
    key material is read once for the prefix, not once a page: a tenant forgotten by then loads
    nothing. ``BlobStoreUnavailableError`` (the store failed, not the page) is raised.
    """
    seal = prefix_seal(store, keys, tenant, out)

    def run(start: int, end: int) -> tuple[int, BlobUnavailableError | TenantMismatchError | None]:
        for i in range(start, end):
            try:
                store.read(keys[i], tenant, out[i], seal)
            except (BlobUnavailableError, TenantMismatchError) as exc:
                return i, exc
        return end, None

    # One contiguous run of pages per thread, not one task per page: a task's hand-off cost
    # ~50 us, a fifth of reading a small page.
    runs = _runs(len(keys), out[0].numel() if len(keys) else 0)
    if len(runs) == 1:
        return run(*runs[0])  # on the caller's thread: a hand-off would only add its cost
    futures = [thread_pool("read", read_threads()).submit(run, start, end) for start, end in runs]
    try:
        for future in futures:
            done, error = future.result()
            if error is not None:
                return done, error
        return len(keys), None
    finally:
        # No read may still be writing into ``out`` once the caller has it back.
        for future in futures:
            future.cancel()
        wait(futures)


def prefix_seal(store: BlobBackend, keys: Sequence[PageKey], tenant: str,
                out: torch.Tensor) -> PageSeal | None:
    """The checks of a prefix read into ``out`` and the seal its pages open with: the tenant's
    key material read once for the prefix, not once a page; None when the tenant has none."""
    if out.dim() != 2 or out.dtype != torch.uint8 or out.shape[0] < len(keys):
        raise ValueError(f"out must be a uint8 tensor with a row for each of {len(keys)} keys, "
                         f"not {out.dtype} of shape {tuple(out.shape)}")
    try:
        return store.keys.for_read(tenant, store.namespace)
    except TenantKeyUnavailableError:
        return None  # each page then says why: another tenant's blob, or no key at all


def read_threads() -> int:
    """Threads a prefix read may use: a thread more than the cores only queues."""
    return max(1, min(READ_THREADS, os.cpu_count() or 1))


def _runs(count: int, page_bytes: int) -> list[tuple[int, int]]:
    """``count`` pages cut into at most ``read_threads()`` contiguous runs of at least
    ``MIN_RUN_BYTES`` each (a smaller run costs more to hand off than it saves); one run for
    pages under ``MIN_THREADED_PAGE_BYTES``."""
    threads = read_threads() if page_bytes >= MIN_THREADED_PAGE_BYTES else 1
    # Counted in whole pages, so that even the shortest run holds MIN_RUN_BYTES.
    pages_per_run = -(-MIN_RUN_BYTES // page_bytes)
    parts = max(1, min(threads, count // pages_per_run))
    bounds = [count * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def write_each(
    store: BlobBackend, keys: Sequence[PageKey], tenant: str, pages: torch.Tensor
) -> list[int]:
    """``store.write`` of ``pages[i]`` as the blob of ``keys[i]`` for every i, several at a time.

    Returns the sizes once every write has ended; raises the first failure (the other blobs are
    written or not, each atomically).
    """
    if len(keys) != len(pages):
        raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
    futures = [thread_pool("write", WRITE_THREADS).submit(store.write, keys[i], tenant, pages[i])
               for i in range(len(keys))]
    wait(futures)
    return [future.result() for future in futures]


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools_after_fork() -> None:
    # A forked child (vLLM forks its engine and workers) has none of the parent's pool threads.
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def thread_pool(kind: str, threads: int) -> ThreadPoolExecutor:
    """One pool per kind for the process, started on first use: a pool per call cost ~0.4 ms of
    thread starts, more than reading a small page."""
    with _POOLS_LOCK:
        pool = _POOLS.get(kind)
        if pool is None:
            pool = _POOLS[kind] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"kvci-blob-{kind}", initializer=on_any_core)
        return pool
