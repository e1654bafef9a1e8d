"""Reading a prefix's blob files a chunk ahead, beside the thread that opens them.

A prefix load from a folder is a blob per page (a 4,096-token hit of the TTFT benchmark: 127
blobs of 256 KiB). On one thread each blob's read (a copy out of the page cache) and its
decryption ran one after the other: 10.5 ms for 32 MiB with the last-level cache cold and the
caller pinned to one of 2 cores (12.2-12.6 ms in the benchmark's paired engine), where
ExampleConnector's whole load took 8-9 ms. Here a thread pinned beside the caller reads the files
of the next chunks while the caller opens those already read: 8.4-9.1 ms (10.0-10.3 in the
engine). The reader reads a chunk in one native call (``read_files``): reading with ``os``
calls, it needed the GIL between every system call, and the two threads spent their time waiting
for each other (11-13 ms, worse than one thread's 8-9 ms warm). Threads that each read and open
whole runs of pages (``read_prefix``) are no better for small pages, for the same reason.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait

from kvci_plugin.ops._native import read_files
from kvci_plugin.ops.affinity import cores_beside_this_thread, on_any_core, pin_to
from kvci_plugin.tiering.blobs.parallel import read_threads, thread_pool

CHUNK_BYTES = 2 << 20
"""The files the reader reads in one call, in bytes (at least one file): the first chunk is
waited for, later ones are read while the caller opens the earlier."""

CHUNKS_AHEAD = 4
"""Chunks read and not yet opened at most: the read buffer's size, in chunks."""

_rings = threading.local()
_pinned = threading.local()


def read_ahead(paths: Sequence[str], row_bytes: int,
               use: Callable[[int, memoryview | None], bool]) -> None:
    """``use(i, data)`` for each file in order, on the calling thread, until it returns False:
    ``data`` is the file's bytes, valid only during the call, or None when the file could not be
    read whole into ``row_bytes`` (missing, unreadable, larger, or not a regular file: a FIFO is
    opened without blocking, and nothing is read beyond a row). Returns once no read is in
    flight. The reader runs on the cores the calling thread is not pinned to (any core when it
    is not pinned); with one core the chunks are read on the calling thread."""
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, not {row_bytes}")
    per = max(1, CHUNK_BYTES // row_bytes)
    chunks = [(start, min(len(paths), start + per)) for start in range(0, len(paths), per)]
    depth = min(CHUNKS_AHEAD, len(chunks))
    ring = _ring(depth * per * row_bytes)

    def fetch(c: int) -> tuple[memoryview, list[int]]:
        start, end = chunks[c]
        at = (c % depth) * per * row_bytes
        view = ring[at : at + (end - start) * row_bytes]
        return view, read_files(paths[start:end], view)

    if read_threads() > 1:
        pool, beside = thread_pool("read-ahead", 1), frozenset(cores_beside_this_thread())

        def submit(c: int) -> Future[tuple[memoryview, list[int]]]:
            return pool.submit(_on_cores, beside, fetch, c)
    else:
        def submit(c: int) -> Future[tuple[memoryview, list[int]]]:
            done: Future[tuple[memoryview, list[int]]] = Future()
            done.set_result(fetch(c))
            return done

    pending = deque(submit(c) for c in range(depth))
    try:
        for c, (start, end) in enumerate(chunks):
            view, sizes = pending.popleft().result()
            for i in range(start, end):
                size, at = sizes[i - start], (i - start) * row_bytes
                if not use(i, view[at : at + size] if size >= 0 else None):
                    return
            if c + depth < len(chunks):  # into the slot just opened
                pending.append(submit(c + depth))
    finally:
        # No read may still be writing into the buffer once the caller has it back.
        for future in pending:
            future.cancel()
        wait(pending)


def _ring(nbytes: int) -> memoryview:
    """This thread's read buffer, reused from load to load (a fresh one spent more time faulting
    its memory in than the read itself)."""
    ring = getattr(_rings, "buf", None)
    if ring is None or len(ring) < nbytes:
        ring = _rings.buf = bytearray(nbytes)
    return memoryview(ring)


def _on_cores(cores: frozenset[int], fetch: Callable[[int], tuple[memoryview, list[int]]],
              c: int) -> tuple[memoryview, list[int]]:
    """``fetch(c)`` on ``cores`` (every core when empty): the reader thread is pinned beside
    the caller's pinned thread. Free to use any core, the kernel woke it on the caller's own,
    where it ran in turn with the caller (engine probe: no gain at all)."""
    if getattr(_pinned, "cores", None) != cores:
        if cores:
            pin_to(set(cores))
        else:
            on_any_core()
        _pinned.cores = cores  # refused by the cpuset: the mask stays, and is not asked again
    return fetch(c)
