"""The blob read and write pools: shared by the process (a forked child gets its own), a prefix
read split into contiguous runs, one a thread (small pages: one run, on the caller's thread),
and threads that run on any core.

vLLM forks its engine core and workers from the process that built the engine, which may have
read or written blobs already: a child must not submit to the parent's pool, whose threads it
does not have (every read would wait forever).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvci_plugin.tiering.blobs.errors import BlobMissingError
from kvci_plugin.tiering.blobs.folder import BlobStore
from kvci_plugin.tiering.blobs.parallel import (
    MIN_RUN_BYTES,
    MIN_THREADED_PAGE_BYTES,
    READ_THREADS,
    _runs,
    read_prefix,
    read_threads,
    thread_pool,
    write_each,
)

NAMESPACE = bytes(range(32))


def _read_back(root: Path, keys: list[bytes], pages: torch.Tensor) -> None:
    # numpy, not torch ops: torch's OpenMP threads, started in the parent, hang a forked child.
    out = torch.from_numpy(np.zeros(tuple(pages.shape), dtype=np.uint8))
    n, error = read_prefix(BlobStore(root, NAMESPACE), keys, "acme", out)
    os._exit(
        0 if (n, error) == (len(keys), None) and np.array_equal(out.numpy(), pages.numpy()) else 1
    )


def test_a_forked_child_reads_with_pools_of_its_own(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, NAMESPACE)
    count = 2 * MIN_RUN_BYTES // MIN_THREADED_PAGE_BYTES  # two runs: read on the pool's threads
    keys = [os.urandom(16) for _ in range(count)]
    pages = torch.randint(0, 256, (count, MIN_THREADED_PAGE_BYTES), dtype=torch.uint8)
    write_each(store, keys, "acme", pages)
    out = torch.zeros_like(pages)
    assert read_prefix(store, keys, "acme", out) == (count, None)  # the parent's pools now run

    child = multiprocessing.get_context("fork").Process(
        target=_read_back, args=(tmp_path, keys, pages)
    )
    child.start()
    child.join(timeout=60)
    hung = child.exitcode is None
    if hung:
        child.kill()
    assert not hung, "the forked child's read never finished"
    assert child.exitcode == 0


def test_a_prefix_read_in_several_runs_counts_the_leading_run(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, NAMESPACE)
    page = MIN_THREADED_PAGE_BYTES
    count = READ_THREADS * MIN_RUN_BYTES // page * 2  # enough bytes for every read thread
    keys = [os.urandom(16) for _ in range(count)]
    pages = torch.randint(0, 256, (count, page), dtype=torch.uint8)
    write_each(store, keys, "acme", pages)
    assert len(_runs(count, page)) == read_threads()
    out = torch.zeros_like(pages)
    assert read_prefix(store, keys, "acme", out) == (count, None)
    assert torch.equal(out, pages)
    for missing in (count - 2, count // 2, 1):  # in the last run, a middle one, the first
        store.delete(keys[missing])
        loaded, error = read_prefix(store, keys, "acme", torch.zeros_like(pages))
        assert loaded == missing and isinstance(error, BlobMissingError)


class _ThreadsSeen:
    """A blob store that notes the thread of every page read."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self.threads: set[str] = set()
        self.keys, self.namespace = store.keys, store.namespace

    def read(self, *args: Any) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        return self._store.read(*args)


@pytest.mark.parametrize("page", [MIN_THREADED_PAGE_BYTES // 4, MIN_THREADED_PAGE_BYTES])
def test_small_pages_are_read_on_the_callers_thread_large_ones_on_several(
    tmp_path: Path, page: int
) -> None:
    store = BlobStore(tmp_path, NAMESPACE)
    count = 4 * MIN_RUN_BYTES // page
    keys = [os.urandom(16) for _ in range(count)]
    pages = torch.randint(0, 256, (count, page), dtype=torch.uint8)
    write_each(store, keys, "acme", pages)
    seen, out = _ThreadsSeen(store), torch.zeros_like(pages)
    assert read_prefix(seen, keys, "acme", out) == (count, None)  # type: ignore[arg-type]
    assert torch.equal(out, pages)
    if page < MIN_THREADED_PAGE_BYTES or read_threads() == 1:
        assert seen.threads == {threading.current_thread().name}
    else:
        assert len(_runs(count, page)) == read_threads()  # a pool thread may take two of them
        assert seen.threads and all(name.startswith("kvci-blob-read") for name in seen.threads)


@given(st.integers(0, 500), st.integers(1, 64 << 20))
def test_read_runs_cover_the_pages_in_order(count: int, page_bytes: int) -> None:
    runs = _runs(count, page_bytes)
    assert [start for start, _ in runs] == [0] + [end for _, end in runs[:-1]]
    assert runs[-1][1] == count
    assert 1 <= len(runs) <= max(1, min(read_threads(), count))
    if len(runs) > 1:
        assert page_bytes >= MIN_THREADED_PAGE_BYTES
        assert all((end - start) * page_bytes >= MIN_RUN_BYTES for start, end in runs)


def _affinity_of_a_read_thread(conn: Any) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as vLLM's CPU worker pins itself
    conn.send(thread_pool("read", READ_THREADS).submit(os.sched_getaffinity, 0).result())


def test_blob_threads_run_on_any_core_a_pinned_caller_may_not() -> None:
    parent, child_end = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_affinity_of_a_read_thread, args=(child_end,)
    )
    child.start()
    got = parent.recv() if parent.poll(60) else None
    child.join(timeout=60)
    assert got == os.sched_getaffinity(0)
