"""The blob backend contract, on a real folder and a real Redis server alike.

What a shared blob location must guarantee: a node never trusts bytes it did not verify (any
flipped byte, a blob under another key or namespace, another tenant's blob), writes of the same
page by several processes at once never leave a torn blob, and listings name every blob so that
reconciliation can find orphans.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from shared_support import NS, OTHER_NS, SLOT, Location, hammer, key_of, page_of

from kvci_plugin.tiering.blobs.errors import BlobIntegrityError, BlobMissingError
from kvci_plugin.tiering.types import TenantMismatchError


def test_round_trip_size_listing_and_delete(location: Location) -> None:
    root = location.open()
    store = root.store(NS)
    keys = [key_of(i) for i in range(5)]
    sizes = store.write_many(keys, "alice", torch.stack([page_of(k) for k in keys]))
    assert sizes == [store.size(k) for k in keys] == [len(location.raw(NS, k)) for k in keys]
    for k in keys:
        assert torch.equal(store.read(k, "alice"), page_of(k))
    listed = {(b.namespace_prefix, b.key_hex) for b in root.listing()}
    assert listed == {(NS.hex()[:32], k.hex()) for k in keys}
    assert all(b.age_s < 60 for b in root.listing())
    assert store.delete(keys[0]) and not store.delete(keys[0])
    with pytest.raises(BlobMissingError):
        store.read(keys[0], "alice")
    with pytest.raises(BlobMissingError):
        store.size(keys[0])
    victim = next(b for b in root.listing() if b.key_hex == keys[1].hex())
    root.remove(victim)
    assert not store.exists(keys[1])
    assert {b.key_hex for b in root.listing()} == {k.hex() for k in keys[2:]}
    root.close()


@pytest.mark.parametrize("position", [0, 7, 100, 300, -1])
def test_a_flipped_byte_is_never_loaded_and_is_quarantined(
    location: Location, position: int
) -> None:
    root = location.open()
    store = root.store(NS)
    key = key_of(1)
    store.write(key, "alice", page_of(key))
    blob = bytearray(location.raw(NS, key))
    blob[position] ^= 0x01
    location.plant(NS, key, bytes(blob))
    out = torch.zeros(SLOT, dtype=torch.uint8)
    with pytest.raises(BlobIntegrityError):
        store.read(key, "alice", out)
    assert not out.any(), "bytes were written before they verified"
    assert not store.exists(key)
    assert store.quarantined() == 1
    with pytest.raises(BlobMissingError):
        store.read(key, "alice")


def test_another_tenant_and_a_moved_blob_are_refused(location: Location) -> None:
    root = location.open()
    store = root.store(NS)
    a, b = key_of(1), key_of(2)
    store.write(a, "alice", page_of(a))
    with pytest.raises(TenantMismatchError):
        store.read(a, "bob")
    with pytest.raises(TenantMismatchError):
        store.write(a, "bob", page_of(a))
    assert torch.equal(store.read(a, "alice"), page_of(a))  # refused, not damaged
    location.plant(NS, b, location.raw(NS, a))
    with pytest.raises(BlobIntegrityError, match="another page"):
        store.read(b, "alice")
    location.plant(OTHER_NS, a, location.raw(NS, a))
    with pytest.raises(BlobIntegrityError, match="another namespace"):
        root.store(OTHER_NS).read(a, "alice")


def test_read_many_counts_the_verified_leading_run(location: Location) -> None:
    store = location.open().store(NS)
    keys = [key_of(i) for i in range(6)]
    store.write_many(keys, "alice", torch.stack([page_of(k) for k in keys]))
    out = torch.zeros((6, SLOT), dtype=torch.uint8)
    assert store.read_many(keys, "alice", out) == (6, None)
    assert torch.equal(out, torch.stack([page_of(k) for k in keys]))
    store.delete(keys[3])
    loaded, error = store.read_many(keys, "alice", torch.zeros((6, SLOT), dtype=torch.uint8))
    assert loaded == 3 and isinstance(error, BlobMissingError)
    loaded, error = store.read_many(keys, "bob", torch.zeros((6, SLOT), dtype=torch.uint8))
    assert loaded == 0 and isinstance(error, TenantMismatchError)


def test_a_long_prefix_loads_up_to_its_first_bad_page(location: Location) -> None:
    """Many pages of 256 KiB (a folder reads them a chunk ahead, the buffer wrapping several
    times): the leading run loads, a flipped byte is quarantined, a missing page stops it."""
    store = location.open().store(NS)
    count, page = 40, 256 << 10
    keys = [key_of(i) for i in range(count)]
    pages = torch.randint(
        0, 256, (count, page), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    store.write_many(keys, "alice", pages)
    out = torch.zeros((count, page), dtype=torch.uint8)
    assert store.read_many(keys, "alice", out) == (count, None)
    assert torch.equal(out, pages)
    store.delete(keys[33])
    blob = bytearray(location.raw(NS, keys[29]))
    blob[-5] ^= 0x10
    location.plant(NS, keys[29], bytes(blob))
    out = torch.zeros((count, page), dtype=torch.uint8)
    loaded, error = store.read_many(keys, "alice", out)
    assert loaded == 29 and isinstance(error, BlobIntegrityError)
    assert torch.equal(out[:29], pages[:29])
    assert not out[29].any(), "bytes were written before they verified"
    assert store.quarantined() == 1 and not store.exists(keys[29])
    loaded, error = store.read_many(keys, "alice", out)
    assert loaded == 29 and isinstance(error, BlobMissingError)


def test_an_intact_blob_is_kept_and_a_bad_one_rewritten(location: Location) -> None:
    store = location.open().store(NS)
    key = key_of(1)
    store.write(key, "alice", page_of(key))
    first = location.raw(NS, key)
    store.write(key, "alice", page_of(key, b"recomputed"))
    assert location.raw(NS, key) == first
    location.plant(NS, key, b"garbage")
    store.write(key, "alice", page_of(key, b"recomputed"))
    assert torch.equal(store.read(key, "alice"), page_of(key, b"recomputed"))


def test_concurrent_writers_of_one_page_never_leave_a_torn_blob(location: Location) -> None:
    """Three processes rewrite the same page while this one reads it: every read either misses
    or returns one writer's whole page."""
    ctx = multiprocessing.get_context("spawn")
    rounds = 40
    writers = [
        ctx.Process(target=hammer, args=(location.kind, location.address, bytes([w]), rounds))
        for w in range(3)
    ]
    for p in writers:
        p.start()
    store = location.open().store(NS)
    valid = {
        bytes(page_of(key_of(0), bytes([w, i])).numpy()) for w in range(3) for i in range(rounds)
    }
    seen = 0
    while any(p.is_alive() for p in writers):
        try:
            got = store.read(key_of(0), "alice")
        except BlobMissingError:
            continue
        assert bytes(got.numpy()) in valid
        seen += 1
    for p in writers:
        p.join()
        assert p.exitcode == 0
    assert store.quarantined() == 0, "a reader saw a torn blob"
    assert bytes(store.read(key_of(0), "alice").numpy()) in valid
    assert seen > 0
