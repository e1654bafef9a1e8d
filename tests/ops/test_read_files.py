"""read_files: a batch of files into the rows of one buffer, without the GIL."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvci_plugin.ops._native import read_files

from .gil_probe import spins_while


def test_each_file_lands_in_its_row_and_says_its_size(tmp_path: Path) -> None:
    contents = [os.urandom(n) for n in (100, 0, 64, 37)]
    paths: list = []
    for i, data in enumerate(contents):
        path = tmp_path / f"f{i}"
        path.write_bytes(data)
        paths.append(path)
    paths = [paths[0], str(paths[1]), os.fsencode(paths[2]), paths[3]]  # PathLike, str, bytes
    out = bytearray(b"\xee" * 4 * 128)
    assert read_files(paths, out) == [len(data) for data in contents]
    for i, data in enumerate(contents):
        row = out[128 * i : 128 * (i + 1)]
        assert row[: len(data)] == data
        assert row[len(data) :] == b"\xee" * (128 - len(data))  # nothing past the file's end


def test_a_file_that_cannot_be_read_whole_says_why_and_leaves_its_row(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 65)
    (tmp_path / "ok").write_bytes(b"y" * 64)
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")  # opened blocking, it would wait for a writer forever
    out = bytearray(b"\xee" * 5 * 64)
    sizes = read_files([tmp_path / "missing", tmp_path / "big", tmp_path / "folder",
                        tmp_path / "fifo", tmp_path / "ok"], out)
    assert sizes == [-errno.ENOENT, -errno.EFBIG, -errno.EISDIR, -errno.EINVAL, 64]
    assert out[:256] == b"\xee" * 256
    assert out[256:] == b"y" * 64


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    # Whoever can write a shared folder could point a blob's name at a device or another file.
    (tmp_path / "target").write_bytes(b"z" * 64)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    out = bytearray(b"\xee" * 64)
    assert read_files([tmp_path / "link"], out) == [-errno.ELOOP]
    assert out == b"\xee" * 64


def test_bad_input_is_refused(tmp_path: Path) -> None:
    assert read_files([], bytearray(3)) == []
    with pytest.raises(ValueError, match="not a whole row for each of 2 paths"):
        read_files([tmp_path, tmp_path], bytearray(3))
    with pytest.raises(BufferError):
        read_files([tmp_path], b"read-only")
    with pytest.raises(TypeError):
        read_files([3], bytearray(8))
    with pytest.raises(ValueError, match="null"):
        read_files(["a\0b"], bytearray(8))
    with pytest.raises(TypeError, match="sequence"):
        read_files(None, bytearray(8))


def test_the_batch_reads_without_the_gil(tmp_path: Path) -> None:
    paths = []
    for i in range(64):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(256 << 10))
        paths.append(path)
    out = bytearray(64 * (256 << 10))

    def work() -> None:
        for _ in range(10):
            read_files(paths, out)

    assert spins_while(work) > 1000
