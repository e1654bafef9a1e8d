"""BlobStore: page blobs in a folder, local or shared by many nodes (NFS, Lustre, CephFS).

It runs next to the KV cache (vLLM's worker side, one per TP rank) and knows only bytes: which
checkpoint a page belongs to is the catalog's business. A blob is named by its page key alone,
so no client string ever reaches a path; the tenant travels inside the blob (``codec``) and
is checked on every read.

Layout under ``root``::

    blobs/<namespace hex[:32]>/<key hex[:2]>/<key hex>.safetensors
    quarantine/<time ns>-<namespace hex[:32]>-<key hex>.safetensors
    keys/<tenant id>.key            a tenant's key material (``tenant_keys``), 0600

Writes are atomic: a temp file in the blob's own folder, written, fsynced, renamed over the
final name, then the folder fsynced. Two nodes writing the same page at once each rename a
whole file over the name, so a reader sees one complete blob or the other, never a mix (rename
is atomic on POSIX file systems, NFS included). A blob that fails any check is moved to the
quarantine folder (kept for inspection, newest ``QUARANTINE_KEEP`` only) and reported as a
miss; its bytes are never returned. A name that is not a regular file (a FIFO, a folder, a
symbolic link) is refused where it is, without waiting on it. A file that cannot be read for
a while (an I/O error, a stale NFS handle, no file descriptor left) is a miss too, and the blob
stays: ``BlobStoreUnavailableError``, never quarantine.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kvci_plugin.tiering.blobs.backend import StoredBlob
from kvci_plugin.tiering.blobs.codec import (
    MAX_PAGE_BYTES,
    NAMESPACE_BYTES,
    blob_room,
    check_namespace,
    check_page,
    encode,
    open_page,
)
from kvci_plugin.tiering.blobs.errors import (
    BlobIntegrityError,
    BlobMissingError,
    BlobStoreUnavailableError,
    BlobUnavailableError,
)
from kvci_plugin.tiering.blobs.parallel import prefix_seal, write_each
from kvci_plugin.tiering.blobs.read_ahead import read_ahead
from kvci_plugin.tiering.blobs.tenant_keys import (
    MATERIAL_BYTES,
    TOMBSTONE,
    PageSeal,
    RootKeyProvider,
    StateDirRootKey,
    TenantKeys,
    TenantKeyUnavailableError,
)
from kvci_plugin.tiering.secret import create_once, replace_file
from kvci_plugin.tiering.types import (
    PageKey,
    TenantMismatchError,
    check_page_key,
    check_tenant,
)

__all__ = [
    "BlobIntegrityError",
    "BlobMissingError",
    "BlobStore",
    "BlobStoreUnavailableError",
    "BlobUnavailableError",
    "FolderBlobRoot",
    "blob_files",
    "check_namespace",
    "fsync_dir",
    "make_private_dir",
    "temp_files",
]

QUARANTINE_KEEP = 64
"""Quarantined blobs kept for inspection; older ones go, so corruption cannot fill a disk."""

BLOB_SUFFIX = ".safetensors"
TEMP_PREFIX = ".kvci-"
TEMP_SUFFIX = ".tmp"
_DIR_MODE = 0o700


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) as 0700 folders, each made durable in its parent."""
    if path.is_dir():
        return
    make_private_dir(path.parent)
    try:
        path.mkdir(mode=_DIR_MODE)
    except FileExistsError:
        return
    # mkdir's mode is filtered by the umask; state it outright.
    os.chmod(path, _DIR_MODE)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make renames and creations inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def blob_files(root: Path) -> Iterator[tuple[str, str, Path]]:
    """Every well-named blob under ``root`` as (namespace hex[:32], key hex, path), any namespace.

    Files that do not follow the layout are not ours and are skipped.
    """
    blobs = root / "blobs"
    if not blobs.is_dir():
        return
    for ns_dir in blobs.iterdir():
        if not (ns_dir.is_dir() and _is_hex(ns_dir.name, NAMESPACE_BYTES // 2)):
            continue
        for fan_dir in ns_dir.iterdir():
            if not (fan_dir.is_dir() and _is_hex(fan_dir.name, 1)):
                continue
            for path in fan_dir.iterdir():
                key_hex = path.name.removesuffix(BLOB_SUFFIX)
                if (
                    path.name.endswith(BLOB_SUFFIX)
                    and _is_hex(key_hex, 16)
                    and key_hex.startswith(fan_dir.name)
                ):
                    yield ns_dir.name, key_hex, path


def temp_files(root: Path) -> Iterator[Path]:
    """Temp files left by writes that never reached their rename, any namespace."""
    yield from (root / "blobs").glob(f"*/*/{TEMP_PREFIX}*{TEMP_SUFFIX}")


def _is_hex(text: str, nbytes: int) -> bool:
    return len(text) == 2 * nbytes and all(c in "0123456789abcdef" for c in text)


def _age(path: Path, now: float) -> float | None:
    try:
        return max(0.0, now - path.stat().st_mtime)
    except FileNotFoundError:
        return None


class FolderMaterials:
    """Tenant key material as files under ``<root>/keys``: created by link (concurrent first
    writes agree on one), replaced by a tombstone or renewed by rename, all made durable in the
    folder."""

    def __init__(self, root: Path) -> None:
        self._dir = Path(root) / "keys"

    def _path(self, tenant_id: str) -> Path:
        if not _is_hex(tenant_id, 16):
            raise ValueError("a tenant id is 32 hex digits")
        return self._dir / f"{tenant_id}.key"

    def read_material(self, tenant_id: str) -> bytes | None:
        # Opened as a blob is (see BlobStore.read): a FIFO or a link here must not block or lead
        # the reader elsewhere.
        try:
            fd = os.open(self._path(tenant_id),
                         os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BlobStoreUnavailableError(
                f"a tenant's key material cannot be opened: {exc}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TenantKeyUnavailableError("the tenant's key material is not a regular file")
            return os.read(fd, MATERIAL_BYTES + 1)  # a longer file is damaged: the seal says so
        except OSError as exc:
            raise BlobStoreUnavailableError(
                f"a tenant's key material cannot be read: {exc}") from exc
        finally:
            os.close(fd)

    def create_material(self, tenant_id: str, material: bytes) -> bytes:
        make_private_dir(self._dir)
        create_once(self._path(tenant_id), material)
        stored = self.read_material(tenant_id)
        if stored is None:
            raise BlobUnavailableError("the tenant's key material vanished as it was created")
        return stored

    def renew_material(self, tenant_id: str, material: bytes) -> bytes:
        if self.read_material(tenant_id) == TOMBSTONE:
            replace_file(self._path(tenant_id), material)
        stored = self.read_material(tenant_id)
        if stored is None:
            raise BlobUnavailableError("the tenant's key material vanished as it was renewed")
        return stored

    def destroy_material(self, tenant_id: str) -> bool:
        try:
            previous = self.read_material(tenant_id)
        except TenantKeyUnavailableError:  # not a regular file: replaced all the same
            previous = None
        make_private_dir(self._dir)
        replace_file(self._path(tenant_id), TOMBSTONE)
        return previous not in (None, TOMBSTONE)

    def sweep_temps(self, min_age_s: float) -> int:
        """Remove the temp copies of material a process killed mid-write left (older than
        ``min_age_s``: a live writer may own a younger one)."""
        now, removed = time.time(), 0
        for path in self._dir.glob(".*.key.*"):
            age = _age(path, now)
            if age is not None and age >= min_age_s:
                path.unlink(missing_ok=True)
                removed += 1
        return removed


def folder_keys(root: Path, root_key: RootKeyProvider | None) -> TenantKeys:
    """The tenant keys of a blob folder under ``root_key`` (default: the node's state_dir)."""
    return TenantKeys((root_key or StateDirRootKey()).root_key(), FolderMaterials(root))


class FolderBlobRoot:
    """A blob folder: hands out one ``BlobStore`` per namespace and lists what it holds."""

    def __init__(self, root: Path, root_key: RootKeyProvider | None = None) -> None:
        self._root = Path(root)
        make_private_dir(self._root)
        self._keys = folder_keys(self._root, root_key)

    @property
    def keys(self) -> TenantKeys:
        return self._keys

    @property
    def root(self) -> Path:
        return self._root

    def describe(self) -> str:
        return f"folder {self._root}"

    def store(self, namespace: bytes) -> BlobStore:
        return BlobStore(self._root, namespace, self._keys)

    def listing(self) -> Iterator[StoredBlob]:
        now = time.time()
        for ns_prefix, key_hex, path in blob_files(self._root):
            age = _age(path, now)
            if age is not None:
                yield StoredBlob(ns_prefix, key_hex, age)

    def remove(self, blob: StoredBlob) -> None:
        path = self._root / "blobs" / blob.namespace_prefix / blob.key_hex[:2]
        (path / f"{blob.key_hex}{BLOB_SUFFIX}").unlink(missing_ok=True)

    def sweep_temps(self, min_age_s: float) -> int:
        """Remove temp files of writes that died, older than ``min_age_s`` (a live writer on
        another node may own a younger one)."""
        now = time.time()
        removed = 0
        for path in temp_files(self._root):
            age = _age(path, now)
            if age is not None and age >= min_age_s:
                path.unlink(missing_ok=True)
                removed += 1
        return removed + FolderMaterials(self._root).sweep_temps(min_age_s)

    def close(self) -> None:
        return


class BlobStore:
    """Content-addressed, sealed, atomically written page blobs of one namespace in a folder.

    Thread-safe, and safe for several processes or nodes on the same folder. ``keys``: the
    folder's tenant keys (default: under the node's state_dir root key).
    """

    def __init__(self, root: Path, namespace: bytes, keys: TenantKeys | None = None) -> None:
        self._root = Path(root)
        self._namespace = check_namespace(namespace)
        self._keys = keys or folder_keys(self._root, None)
        self._ns_hex = namespace.hex()
        self._dir = self._root / "blobs" / self._ns_hex[:32]
        self._dir_name = os.fspath(self._dir)
        self._quarantine = self._root / "quarantine"
        # Orders a quarantine move against a rename into place of the same name, so a reader
        # never quarantines a blob that a writer has just replaced.
        self._lock = threading.Lock()
        self._buffers = threading.local()
        make_private_dir(self._dir)
        make_private_dir(self._quarantine)

    @property
    def root(self) -> Path:
        return self._root

    @property
    def namespace(self) -> bytes:
        return self._namespace

    @property
    def keys(self) -> TenantKeys:
        return self._keys

    def path_for(self, key: PageKey) -> Path:
        return Path(self._file_name(key))

    def _file_name(self, key: PageKey) -> str:
        """``path_for`` as a string: a read builds no Path (a tenth of a small page's read)."""
        key_hex = check_page_key(key, "key").hex()
        return os.path.join(self._dir_name, key_hex[:2], key_hex + BLOB_SUFFIX)

    def exists(self, key: PageKey) -> bool:
        """Whether a blob is present (not whether it verifies: ``read`` says that)."""
        return self.path_for(key).is_file()

    def size(self, key: PageKey) -> int:
        """The blob's size in bytes; ``BlobMissingError`` if there is none."""
        try:
            return self.path_for(key).stat().st_size
        except FileNotFoundError:
            raise BlobMissingError(f"no blob for page {key.hex()}") from None

    def delete(self, key: PageKey) -> bool:
        """Remove the blob; False if there was none.

        Not fsynced: a deletion lost in a crash leaves an orphan that start-up removes.
        """
        try:
            self.path_for(key).unlink()
        except (FileNotFoundError, IsADirectoryError):
            # A directory someone put at a blob's name is no blob: nothing of ours to delete,
            # and no sign that the store is failing.
            return False
        return True

    def write(self, key: PageKey, tenant: str, data: torch.Tensor) -> int:
        """Store ``data`` as the blob of ``key`` durably; return the blob's size.

        An intact blob of the same key and tenant is kept as it is (the key names the content;
        recomputed KV can differ in the last bits, and either copy is valid). A blob that fails
        verification is quarantined and rewritten. A key held by another tenant is refused.
        """
        path = self.path_for(key)
        check_tenant(tenant)
        data = check_page(data, "data")
        if data.device.type != "cpu":
            raise ValueError(f"data must be on the CPU, not {data.device}")
        if path.exists():
            try:
                self.read(key, tenant)
                return path.stat().st_size
            except (BlobUnavailableError, FileNotFoundError):
                pass  # bad, or deleted meanwhile: write it
        blob = encode(self._keys.for_write(tenant, self._namespace), self._namespace, key, data)
        make_private_dir(path.parent)
        # mkstemp creates the file 0600 with an unguessable name.
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=path.parent)
        tmp = Path(tmp_name)
        try:
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        return len(blob)

    def write_many(
        self, keys: Sequence[PageKey], tenant: str, pages: torch.Tensor
    ) -> list[int]:
        """``write`` of ``pages[i]`` as the blob of ``keys[i]`` for every i, several at a time.

        Returns once every write has ended; raises the first failure (the other blobs are
        written or not, each atomically).
        """
        return write_each(self, keys, tenant, pages)

    def read(self, key: PageKey, tenant: str, out: torch.Tensor | None = None,
             seal: PageSeal | None = None) -> torch.Tensor:
        """The authenticated page of ``key`` for ``tenant``, decrypted into ``out`` when given.

        Raises ``BlobMissingError``; ``BlobIntegrityError`` when the name is not a regular file
        (refused, left where it is) or when the file is larger than the blob of a page of
        ``out``'s size (of ``MAX_PAGE_BYTES`` without ``out``), does not parse, names another
        namespace or key, or fails authentication (quarantined); ``BlobStoreUnavailableError``
        when the file cannot be opened or read (the blob stays); ``TenantMismatchError`` when a
        blob names another tenant; ``TenantKeyUnavailableError`` when the tenant has no key
        material (forgotten). ``out`` holds the page only on success.
        """
        path = self._file_name(key)
        check_tenant(tenant)
        if out is not None:
            check_page(out, "out")
        limit = blob_room(MAX_PAGE_BYTES if out is None else out.numel())
        # os calls, not pathlib and a buffered file: per blob they cost a fifth of a small page's
        # read. O_NONBLOCK: a FIFO in a blob's place must not block the reader (no effect on a
        # regular file); O_NOFOLLOW: nor may a link lead it to a device or any other file.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise BlobMissingError(f"no blob for page {key.hex()}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BlobIntegrityError(
                    f"blob of page {key.hex()} is a symbolic link: refused") from None
            raise BlobStoreUnavailableError(
                f"blob of page {key.hex()} cannot be opened: {exc}") from exc
        try:
            seen = os.fstat(fd)  # the file read, should a writer replace the name
            if not stat.S_ISREG(seen.st_mode):
                raise BlobIntegrityError(
                    f"blob of page {key.hex()} is not a regular file: refused")
            if seen.st_size > limit:
                self._quarantine_file(key, path, seen)
                raise BlobIntegrityError(
                    f"blob of page {key.hex()} is {seen.st_size} bytes, more than the blob of "
                    "its page can be; quarantined")
            blob = self._read_into_buffer(fd, seen.st_size)
        except OSError as exc:
            raise BlobStoreUnavailableError(
                f"blob of page {key.hex()} cannot be read: {exc}") from exc
        finally:
            os.close(fd)
        return open_page(blob, self._keys, tenant, self._namespace, key, out,
                         lambda: self._quarantine_file(key, path, seen), seal)

    def _read_into_buffer(self, fd: int, size: int) -> memoryview:
        """The file's bytes in this thread's read buffer, reused from read to read: a fresh
        buffer per blob spent 10x the read itself faulting its memory in. The view is valid
        until this thread's next read (``open_page`` copies the page out before that)."""
        buf = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._buffers.buf = bytearray(size)
        view = memoryview(buf)[:size]
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], got)
            if not n:
                break  # shorter than its size a moment ago: the checks below refuse it
            got += n
        return view[:got]

    def read_many(
        self, keys: Sequence[PageKey], tenant: str, out: torch.Tensor
    ) -> tuple[int, BlobUnavailableError | TenantMismatchError | None]:
        """``read`` of ``keys[i]`` into ``out[i]``; (pages verified, first failure). Only the
        leading run of pages that verified counts (KV is a prefix): rows past it hold nothing
        meaningful.

        The files are read a chunk ahead on another thread (``read_ahead``) while this one opens
        them. A blob that does not open from there is read again by ``read``, which quarantines
        it or says why it cannot be served (and serves it, should a writer have replaced it).
        ``BlobStoreUnavailableError`` (the folder cannot be read) is raised, not returned: it
        says nothing of the page.
        """
        check_tenant(tenant)
        seal = prefix_seal(self, keys, tenant, out)
        first_failure: list[tuple[int, BlobUnavailableError | TenantMismatchError]] = []

        def open_one(i: int, blob: memoryview | None) -> bool:
            try:
                if blob is not None:
                    open_page(blob, self._keys, tenant, self._namespace, keys[i], out[i],
                              _not_here, seal)
                    return True
            except (BlobUnavailableError, TenantMismatchError):
                pass
            try:
                self.read(keys[i], tenant, out[i], seal)
            except (BlobUnavailableError, TenantMismatchError) as exc:
                first_failure.append((i, exc))
                return False
            return True

        if keys:
            read_ahead([self._file_name(key) for key in keys], blob_room(out.shape[1]), open_one)
        return first_failure[0] if first_failure else (len(keys), None)

    def quarantined(self) -> int:
        """How many quarantined blobs are kept."""
        return sum(1 for _ in self._quarantine.glob(f"*{BLOB_SUFFIX}"))

    def _quarantine_file(self, key: PageKey, path: str, seen: os.stat_result) -> None:
        # The time leads the name so that name order is age order.
        target = self._quarantine / f"{time.time_ns()}-{self._ns_hex[:32]}-{key.hex()}{BLOB_SUFFIX}"
        with self._lock:
            try:
                now = os.stat(path)
                if (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
                    return  # replaced by a fresh write since it was read: not the bad file
                os.replace(path, target)
                kept = sorted(self._quarantine.glob(f"*{BLOB_SUFFIX}"))
                for old in kept[:-QUARANTINE_KEEP]:
                    old.unlink(missing_ok=True)
            except OSError:
                return  # best effort: the blob is refused either way


def _not_here() -> None:
    """A blob read ahead that fails is not quarantined from there: ``read`` reads it again and
    quarantines the file it read, not a replacement written since."""
