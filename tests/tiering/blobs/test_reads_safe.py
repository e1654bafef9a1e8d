"""A blob folder's reads open regular files only, never block, bound what they read, and tell a
store that fails for a while from a bad blob (real files, a real FIFO, a real full tmpfs)."""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from thread_support import within

from kvci_plugin.tiering.blobs.codec import MAX_PAGE_BYTES, blob_room
from kvci_plugin.tiering.blobs.errors import (
    BlobIntegrityError,
    BlobStoreUnavailableError,
    BlobUnavailableError,
)
from kvci_plugin.tiering.blobs.folder import BlobStore, temp_files

NS = hashlib.sha256(b"model=tiny;dtype=bf16;block=32;tp=0/1").digest()
SLOT = 4096


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"key-{i}".encode()).digest()[:16]


def page_of(key: bytes, size: int = SLOT) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(size)), dtype=torch.uint8)


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "root", NS)


@pytest.fixture
def fifo(store: BlobStore) -> Iterator[Path]:
    """A FIFO at the blob name of ``key_of(1)``; a reader left blocked on it is released."""
    path = store.path_for(key_of(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    yield path
    try:  # a writer's open succeeds only while a reader waits: it wakes that reader
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waits


def test_a_fifo_at_a_blobs_name_is_refused_without_waiting(store: BlobStore, fifo: Path) -> None:
    key = key_of(1)
    refused = within(5, lambda: store.read(key, "alice", torch.empty(SLOT, dtype=torch.uint8)))
    assert isinstance(refused, BlobIntegrityError), refused
    refused = within(5, lambda: store.read(key, "alice"))
    assert isinstance(refused, BlobIntegrityError), refused
    # In a prefix: the pages before it load, it is the first failure.
    keys = [key_of(0), key, key_of(2)]
    store.write(keys[0], "alice", page_of(keys[0]))
    store.write(keys[2], "alice", page_of(keys[2]))
    out = torch.zeros((3, SLOT), dtype=torch.uint8)
    loaded, error = within(5, lambda: store.read_many(keys, "alice", out))  # type: ignore[misc]
    assert loaded == 1 and isinstance(error, BlobIntegrityError)
    assert torch.equal(out[0], page_of(keys[0]))
    # Refused where it is: moving it could fail or block, and it holds nothing to inspect.
    assert fifo.exists() and store.quarantined() == 0


def test_a_folder_at_a_blobs_name_is_refused_and_left(store: BlobStore) -> None:
    key = key_of(1)
    folder = store.path_for(key)
    folder.mkdir(parents=True)
    with pytest.raises(BlobIntegrityError, match="not a regular file"):
        store.read(key, "alice")
    out = torch.zeros((1, SLOT), dtype=torch.uint8)
    loaded, error = store.read_many([key], "alice", out)
    assert loaded == 0 and isinstance(error, BlobIntegrityError)
    assert folder.is_dir() and store.quarantined() == 0
    # Discarding the page deletes no blob and raises nothing: a folder is no sign that the
    # store fails (an OSError here would degrade the whole tier for every tenant).
    assert store.delete(key) is False


def test_a_link_at_a_blobs_name_is_not_followed(store: BlobStore, tmp_path: Path) -> None:
    """Whoever can write the folder must not lead a reader to another file (a device, a FIFO,
    a file of another folder): even a link to the page's own blob is refused."""
    key = key_of(1)
    path = store.path_for(key)
    store.write(key, "alice", page_of(key))
    elsewhere = tmp_path / "elsewhere.safetensors"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(BlobIntegrityError, match="symbolic link"):
        store.read(key, "alice")
    assert path.is_symlink() and elsewhere.is_file() and store.quarantined() == 0


@pytest.mark.parametrize("told", [True, False], ids=["page size told", "page size not told"])
def test_a_huge_sparse_file_is_refused_before_it_is_read(store: BlobStore, told: bool) -> None:
    """A buffer sized from the file would take 256 GiB: refused from its size alone."""
    key = key_of(1)
    path = store.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.truncate(256 << 30)
    assert path.stat().st_size > blob_room(MAX_PAGE_BYTES)
    out = torch.empty(SLOT, dtype=torch.uint8) if told else None
    started = time.monotonic()
    with pytest.raises(BlobIntegrityError, match="more than the blob of its page can be"):
        store.read(key, "alice", out)
    assert time.monotonic() - started < 1.0
    assert not path.exists() and store.quarantined() == 1


def test_a_file_a_byte_past_its_room_is_refused(store: BlobStore) -> None:
    """The bound is the largest blob of the page's size, not more."""
    key = key_of(1)
    store.write(key, "alice", page_of(key))
    path = store.path_for(key)
    with open(path, "r+b") as file:
        file.truncate(blob_room(SLOT) + 1)
    with pytest.raises(BlobIntegrityError, match="more than the blob of its page can be"):
        store.read(key, "alice", torch.empty(SLOT, dtype=torch.uint8))


class _NoFileDescriptorsLeft:
    """While active, opening any file fails with EMFILE (a real limit, lowered and restored)."""

    def __enter__(self) -> None:
        self._limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest_free = os.open(os.devnull, os.O_RDONLY)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, self._limits[1]))

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, self._limits)


def test_a_file_that_cannot_be_opened_for_a_while_is_not_a_bad_blob(store: BlobStore) -> None:
    """EMFILE (as EIO, ESTALE): the store failed, not the page. The blob is neither
    quarantined nor reported bad (which would make every node forget it)."""
    keys = [key_of(0), key_of(1)]
    for key in keys:
        store.write(key, "alice", page_of(key))
    out = torch.zeros((2, SLOT), dtype=torch.uint8)
    with _NoFileDescriptorsLeft():
        with pytest.raises(BlobStoreUnavailableError) as raised:
            store.read(keys[0], "alice")
        with pytest.raises(BlobStoreUnavailableError):
            store.read_many(keys, "alice", out)
    assert not isinstance(raised.value, BlobUnavailableError)
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.EMFILE
    assert store.quarantined() == 0
    assert store.read_many(keys, "alice", out) == (2, None)
    assert torch.equal(out[1], page_of(keys[1]))


@pytest.fixture
def tiny_file_system(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs, unmounted afterwards."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_file_system_fails_a_write_cleanly(tiny_file_system: Path) -> None:
    """ENOSPC mid-write: the write raises, no blob is left under the name, the temp file is
    gone (its space with it), and the folder takes a page that fits."""
    store = BlobStore(tiny_file_system / "root", NS)
    big, small = key_of(1), key_of(2)
    with pytest.raises(OSError) as raised:
        store.write(big, "alice", page_of(big, 3 << 20))
    assert raised.value.errno == errno.ENOSPC
    assert not store.path_for(big).exists()
    assert list(temp_files(store.root)) == []
    store.write(small, "alice", page_of(small))
    assert torch.equal(store.read(small, "alice"), page_of(small))
