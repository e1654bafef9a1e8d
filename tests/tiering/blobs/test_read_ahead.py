"""read_ahead: a prefix's files read a chunk ahead on another thread, used in order on the
caller's."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvci_plugin.tiering.blobs import read_ahead as module
from kvci_plugin.tiering.blobs.read_ahead import CHUNK_BYTES, CHUNKS_AHEAD, read_ahead

ROW = CHUNK_BYTES // 4  # 4 files a chunk


def _files(tmp_path: Path, count: int) -> tuple[list[str], list[bytes | None]]:
    """``count`` files of sizes up to ROW; every seventh missing, every eleventh a byte too big."""
    paths, contents = [], []
    for i in range(count):
        path = tmp_path / f"f{i}"
        paths.append(str(path))
        if i % 7 == 3:
            contents.append(None)
            continue
        data = os.urandom(ROW + 1 if i % 11 == 5 else (i * 7919) % ROW)
        path.write_bytes(data)
        contents.append(None if len(data) > ROW else data)
    return paths, contents


def test_every_file_is_used_in_order_with_its_bytes(tmp_path: Path) -> None:
    count = 4 * (CHUNKS_AHEAD + 3) + 2  # the buffer wraps; the last chunk is short
    paths, contents = _files(tmp_path, count)
    seen: list[tuple[int, bytes | None]] = []
    for _ in range(2):  # the second load reuses this thread's buffer
        seen.clear()
        read_ahead(
            paths,
            ROW,
            lambda i, data: seen.append((i, None if data is None else bytes(data))) or True,
        )
        assert seen == list(enumerate(contents))


def test_it_stops_when_told_with_no_read_left_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, _ = _files(tmp_path, 4 * (CHUNKS_AHEAD + 2))
    reads: list[int] = []
    real = module.read_files

    def counted(chunk: list[str], out: memoryview) -> list[int]:
        sizes = real(chunk, out)
        reads.append(len(chunk))
        return sizes

    monkeypatch.setattr(module, "read_files", counted)
    used: list[int] = []
    read_ahead(paths, ROW, lambda i, data: used.append(i) or i < 5)
    assert used == list(range(6))
    # Chunks 0..CHUNKS_AHEAD were asked for: each was read or cancelled before read_ahead
    # returned, and none is read after it.
    finished = len(reads)
    threading.Event().wait(0.2)
    assert len(reads) == finished


@pytest.mark.parametrize("cores", [1, 2])
def test_the_reads_run_beside_the_caller_unless_there_is_one_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int
) -> None:
    paths, contents = _files(tmp_path, 4 * CHUNKS_AHEAD)
    readers: set[tuple[str, frozenset[int]]] = set()
    real = module.read_files

    def recorded(chunk: list[str], out: memoryview) -> list[int]:
        readers.add((threading.current_thread().name, frozenset(os.sched_getaffinity(0))))
        return real(chunk, out)

    monkeypatch.setattr(module, "read_files", recorded)
    monkeypatch.setattr(module, "read_threads", lambda: cores)
    seen: list[bytes | None] = []
    read_ahead(
        paths, ROW, lambda i, data: seen.append(None if data is None else bytes(data)) or True
    )
    assert seen == contents
    caller = threading.current_thread().name
    if cores == 1:
        assert {name for name, _ in readers} == {caller}
        return
    assert len(readers) == 1 and caller not in {name for name, _ in readers}
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        return  # nowhere beside the caller to pin to
    # A caller pinned to one core (as vLLM pins its CPU worker's forward): the reader runs on
    # the others, not where the kernel would wake it (the caller's own core).
    first = min(allowed)
    os.sched_setaffinity(0, {first})
    try:
        readers.clear()
        read_ahead(paths, ROW, lambda i, data: True)
    finally:
        os.sched_setaffinity(0, allowed)
    assert {cores_of for _, cores_of in readers} == {frozenset(allowed - {first})}
    readers.clear()
    read_ahead(paths, ROW, lambda i, data: True)  # an unpinned caller: any core again
    assert {cores_of for _, cores_of in readers} == {frozenset(allowed)}


def test_a_row_must_hold_something() -> None:
    with pytest.raises(ValueError, match="row_bytes must be positive"):
        read_ahead(["x"], 0, lambda i, data: True)
