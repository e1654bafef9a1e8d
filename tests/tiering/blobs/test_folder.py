"""BlobStore: verified, atomically written, tenant-checked page blobs (real files)."""

from __future__ import annotations

import hashlib
import shutil
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kvci_plugin.tiering.blobs.codec import blob_room
from kvci_plugin.tiering.blobs.errors import BlobIntegrityError, BlobMissingError
from kvci_plugin.tiering.blobs.folder import QUARANTINE_KEEP, BlobStore, blob_files, temp_files
from kvci_plugin.tiering.types import TenantMismatchError

NS = hashlib.sha256(b"model=tiny;dtype=bf16;block=32;tp=0/1").digest()
OTHER_NS = hashlib.sha256(b"model=tiny;dtype=fp16;block=32;tp=0/1").digest()
SLOT = 256


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"key-{i}".encode()).digest()[:16]


def page_of(key: bytes, size: int = SLOT) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(size)), dtype=torch.uint8)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "root", NS)


def test_round_trip_layout_metadata_and_permissions(store: BlobStore, tmp_path: Path) -> None:
    key = key_of(1)
    page = page_of(key)
    size = store.write(key, "alice", page)

    path = store.path_for(key)
    assert path == (
        tmp_path / "root" / "blobs" / NS.hex()[:32] / key.hex()[:2] / f"{key.hex()}.safetensors"
    )
    assert size == path.stat().st_size > SLOT
    assert torch.equal(store.read(key, "alice"), page)
    with safe_open(path, framework="pt") as blob:
        meta = blob.metadata()
        assert list(blob.keys()) == ["sealed"]
        sealed = blob.get_tensor("sealed")
    assert meta["format"] == "kvci.page.v2"
    assert meta["namespace"] == NS.hex()
    assert meta["key"] == key.hex()
    # The tenant is named by a keyed id, and the page is not there in the clear.
    assert meta["tenant"] == store.keys.tenant_id(
        "alice"
    ) and "alice" not in path.read_bytes().decode("latin-1")
    assert meta["bytes"] == str(SLOT)
    assert page.numpy().tobytes() not in path.read_bytes()
    assert sealed.numel() == SLOT + 16
    assert mode(path) == 0o600
    for folder in (
        path.parent,
        path.parent.parent,
        tmp_path / "root" / "blobs",
        tmp_path / "root" / "quarantine",
        tmp_path / "root",
    ):
        assert mode(folder) == 0o700, folder
    assert list(temp_files(tmp_path / "root")) == []
    assert [(ns, k) for ns, k, _ in blob_files(tmp_path / "root")] == [(NS.hex()[:32], key.hex())]


def test_read_into_out_and_size_mismatch(store: BlobStore) -> None:
    key = key_of(2)
    store.write(key, "alice", page_of(key))
    out = torch.zeros(SLOT, dtype=torch.uint8)
    assert store.read(key, "alice", out) is out
    assert torch.equal(out, page_of(key))
    with pytest.raises(ValueError, match="out holds"):
        store.read(key, "alice", torch.zeros(SLOT + 1, dtype=torch.uint8))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[BlobStore, bytes, bytes]:
    """One blob written once; each example damages a copy of its bytes in place."""
    store = BlobStore(tmp_path_factory.mktemp("pristine"), NS)
    key = key_of(3)
    store.write(key, "alice", page_of(key))
    return store, key, store.path_for(key).read_bytes()


@settings(max_examples=150, deadline=None)
@given(position=st.integers(min_value=0), mask=st.integers(min_value=1, max_value=255))
def test_a_blob_with_one_flipped_byte_is_never_loaded(
    pristine: tuple[BlobStore, bytes, bytes], position: int, mask: int
) -> None:
    store, key, raw = pristine
    damaged = bytearray(raw)
    damaged[position % len(raw)] ^= mask
    path = store.path_for(key)
    path.write_bytes(bytes(damaged))
    out = torch.full((SLOT,), 7, dtype=torch.uint8)

    with pytest.raises((BlobIntegrityError, TenantMismatchError)) as refused:
        store.read(key, "alice", out)

    assert torch.all(out == 7) or torch.all(out == 0), "out holds unauthenticated bytes"
    if refused.type is BlobIntegrityError:
        assert not path.exists()
        assert store.quarantined() >= 1
        with pytest.raises(BlobMissingError):
            store.read(key, "alice")
        return
    # A flip in the tenant id names another tenant: refused, as another tenant's blob is.
    assert path.exists()


@settings(max_examples=40, deadline=None)
@given(keep=st.integers(min_value=0))
def test_a_truncated_blob_is_never_loaded(
    pristine: tuple[BlobStore, bytes, bytes], keep: int
) -> None:
    store, key, raw = pristine
    store.path_for(key).write_bytes(raw[: keep % len(raw)])
    with pytest.raises(BlobIntegrityError):
        store.read(key, "alice")
    assert not store.path_for(key).exists()


def test_another_tenant_is_refused_and_the_blob_kept(store: BlobStore) -> None:
    key = key_of(5)
    store.write(key, "alice", page_of(key))
    out = torch.full((SLOT,), 7, dtype=torch.uint8)
    with pytest.raises(TenantMismatchError) as refused:
        store.read(key, "bob", out)
    assert "alice" not in str(refused.value)
    assert torch.all(out == 7)
    assert store.quarantined() == 0
    assert torch.equal(store.read(key, "alice"), page_of(key))


def test_a_blob_moved_to_another_key_or_namespace_is_refused(
    store: BlobStore, tmp_path: Path
) -> None:
    a, b = key_of(6), key_of(7)
    store.write(a, "alice", page_of(a))
    store.path_for(b).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(store.path_for(a), store.path_for(b))
    with pytest.raises(BlobIntegrityError, match="another page"):
        store.read(b, "alice")

    other = BlobStore(tmp_path / "root", OTHER_NS)
    other.write(a, "alice", page_of(a))
    shutil.copy(other.path_for(a), store.path_for(a))
    with pytest.raises(BlobIntegrityError, match="another namespace"):
        store.read(a, "alice")


def test_missing_exists_delete(store: BlobStore) -> None:
    key = key_of(8)
    assert not store.exists(key)
    with pytest.raises(BlobMissingError):
        store.read(key, "alice")
    store.write(key, "alice", page_of(key))
    assert store.exists(key)
    assert store.delete(key)
    assert not store.delete(key)
    assert not store.exists(key)


def test_an_intact_blob_is_not_rewritten_a_bad_one_is(store: BlobStore) -> None:
    key = key_of(9)
    store.write(key, "alice", page_of(key))
    path = store.path_for(key)
    before = path.stat()

    # Recomputed KV may differ in the last bits: the blob already held stays.
    store.write(key, "alice", torch.zeros(SLOT, dtype=torch.uint8))
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert torch.equal(store.read(key, "alice"), page_of(key))

    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    store.write(key, "alice", page_of(key))
    assert store.quarantined() == 1
    assert torch.equal(store.read(key, "alice"), page_of(key))


def test_a_key_held_by_another_tenant_is_not_overwritten(store: BlobStore) -> None:
    key = key_of(10)
    store.write(key, "alice", page_of(key))
    with pytest.raises(TenantMismatchError):
        store.write(key, "bob", torch.zeros(SLOT, dtype=torch.uint8))
    assert torch.equal(store.read(key, "alice"), page_of(key))
    assert list(temp_files(store.root)) == []


def test_quarantine_keeps_only_the_newest(store: BlobStore) -> None:
    for i in range(QUARANTINE_KEEP + 3):
        key = key_of(100 + i)
        store.write(key, "alice", page_of(key))
        store.path_for(key).write_bytes(b"not a safetensors file")
        with pytest.raises(BlobIntegrityError):
            store.read(key, "alice")
    kept = sorted(p.name for p in (store.root / "quarantine").iterdir())
    assert len(kept) == QUARANTINE_KEEP
    assert kept[-1].endswith(f"{key_of(100 + QUARANTINE_KEEP + 2).hex()}.safetensors")
    assert not any(key_of(100).hex() in name for name in kept)


def test_temp_files_are_found_for_reconciliation(store: BlobStore) -> None:
    key = key_of(11)
    store.write(key, "alice", page_of(key))
    planted = store.path_for(key).parent / ".kvci-abc123.tmp"
    planted.write_bytes(b"torn")
    assert list(temp_files(store.root)) == [planted]


def test_bad_input_is_named(store: BlobStore, tmp_path: Path) -> None:
    page = page_of(key_of(12))
    with pytest.raises(ValueError, match="16 bytes"):
        store.write(b"short", "alice", page)
    with pytest.raises(TypeError, match="bytes"):
        store.write("0" * 32, "alice", page)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tenant"):
        store.write(key_of(12), "", page)
    with pytest.raises(ValueError, match="1-D uint8"):
        store.write(key_of(12), "alice", page.view(16, 16))
    with pytest.raises(ValueError, match="1-D uint8"):
        store.write(key_of(12), "alice", page.to(torch.int16))
    with pytest.raises(ValueError, match="empty"):
        store.write(key_of(12), "alice", torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="32 bytes"):
        BlobStore(tmp_path / "x", b"short")
    assert not store.exists(key_of(12))


def test_write_many_writes_every_page(store: BlobStore) -> None:
    keys = [key_of(300 + i) for i in range(12)]
    pages = torch.stack([page_of(k) for k in keys])
    sizes = store.write_many(keys, "alice", pages)
    assert sizes == [store.path_for(k).stat().st_size for k in keys]
    for k in keys:
        assert torch.equal(store.read(k, "alice"), page_of(k))
    assert list(temp_files(store.root)) == []
    with pytest.raises(ValueError, match="13 keys for 12 pages"):
        store.write_many([*keys, key_of(400)], "alice", pages)


def test_a_prefix_read_refuses_a_blob_grown_past_its_room(store: BlobStore) -> None:
    """A file longer than any blob of its page size is not read ahead: ``read`` reads it,
    refuses it and quarantines it; the pages before it load."""
    keys = [key_of(i) for i in range(3)]
    store.write_many(keys, "alice", torch.stack([page_of(k) for k in keys]))
    path = store.path_for(keys[1])
    path.write_bytes(path.read_bytes() + bytes(blob_room(SLOT)))
    out = torch.zeros((3, SLOT), dtype=torch.uint8)
    loaded, error = store.read_many(keys, "alice", out)
    assert loaded == 1 and isinstance(error, BlobIntegrityError)
    assert torch.equal(out[0], page_of(keys[0])) and not out[1].any()
    assert store.quarantined() == 1 and not path.exists()
