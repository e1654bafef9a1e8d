"""Security at rest on the shared disk tier: a PostgreSQL catalog and a shared folder or Redis.

A blob forged by a writer who has the store but not the root key, a blob copied from one
tenant's page to another's, and every single-bit flip are refused (and the forged and flipped
ones quarantined and forgotten); `forget` on node A makes node B load nothing of that tenant
while other tenants still hit, a restart does not resurrect it, and no key appears in what a
forget or a refusal says.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
import torch
from shared_support import NS, Location, key_of, open_node, page_of

from kvci_plugin.tiering.blobs.codec import encode
from kvci_plugin.tiering.blobs.errors import BlobIntegrityError, BlobMissingError
from kvci_plugin.tiering.blobs.tenant_keys import TenantKeys, TenantKeyUnavailableError
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.types import TenantForgottenError, TenantMismatchError


def persist(store, checkpoint_id: str, keys: list[bytes], tenant: str):
    return store.persist(
        checkpoint_id, tenant, keys, pages(keys, tenant), "agent", "{}", "{}", None
    )


def pages(keys: list[bytes], tenant: str) -> torch.Tensor:
    return torch.stack([page_of(k, tenant.encode()) for k in keys])


def tenant_keys(tenant: str, n: int = 3) -> list[bytes]:
    return [hashlib.sha256(f"{tenant}-{i}".encode()).digest()[:16] for i in range(n)]


def test_a_blob_forged_without_the_root_key_is_refused_and_quarantined(
    location: Location, pg_catalog_url: str
) -> None:
    node = open_node(location.kind, location.address, pg_catalog_url)
    keys = tenant_keys("alice")
    persist(node, "ctx", keys, "alice")
    victim = location.raw(NS, keys[1])
    # The forger has the store (the blob, the tenant id and the material beside it) but a root
    # key of their own: they seal their bytes under it with the victim's material.
    root = location.open()
    material = root.keys._materials.read_material(root.keys.tenant_id("alice"))
    assert material is not None

    class Stolen:
        def read_material(self, tenant_id: str) -> bytes:
            return material

    forger = TenantKeys(os.urandom(32), Stolen())  # type: ignore[arg-type]
    forged = bytearray(
        encode(forger.for_read("alice", NS), NS, keys[1], torch.zeros(512, dtype=torch.uint8))
    )
    header_len = int.from_bytes(forged[:8], "little")
    header = json.loads(forged[8 : 8 + header_len])
    header["__metadata__"]["tenant"] = json.loads(
        victim[8 : 8 + int.from_bytes(victim[:8], "little")]
    )["__metadata__"]["tenant"]
    text = json.dumps(header, separators=(",", ":")).encode()
    forged[8 : 8 + header_len] = text + b" " * (header_len - len(text))
    location.plant(NS, keys[1], bytes(forged))

    other = open_node(location.kind, location.address, pg_catalog_url)
    store = root.store(NS)
    before = store.quarantined()
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        other.load("ctx", "alice")
    assert store.quarantined() == before + 1
    assert location.raw(NS, keys[1]) is None
    # Forgotten for every node: the page and the checkpoint needing it are gone from the catalog.
    assert node.longest_prefix(keys, "alice") == 1
    node.close()
    other.close()


def test_a_blob_copied_from_one_tenants_page_to_anothers_is_refused(
    location: Location, pg_catalog_url: str
) -> None:
    node = open_node(location.kind, location.address, pg_catalog_url)
    a_keys, b_keys = tenant_keys("alice"), tenant_keys("bob")
    persist(node, "a", a_keys, "alice")
    persist(node, "b", b_keys, "bob")
    location.plant(NS, b_keys[0], location.raw(NS, a_keys[0]))
    store = location.open().store(NS)
    before = store.quarantined()
    with pytest.raises(BlobIntegrityError, match="another page"):
        store.read(b_keys[0], "bob")
    assert store.quarantined() == before + 1
    # Another node sees the page gone: a miss for bob, recomputed; alice's pages still serve.
    other = open_node(location.kind, location.address, pg_catalog_url)
    assert other.longest_prefix(b_keys, "bob") == 0
    assert torch.equal(other.load("a", "alice"), pages(a_keys, "alice"))
    # Renamed in its metadata too (the page key rewritten to bob's): the tag refuses it.
    blob = bytearray(location.raw(NS, a_keys[1]))
    at = blob.index(a_keys[1].hex().encode())
    blob[at : at + 32] = b_keys[1].hex().encode()
    location.plant(NS, b_keys[1], bytes(blob))
    with pytest.raises(TenantMismatchError):
        store.read(b_keys[1], "bob")  # it names alice's tenant id
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        store.read(b_keys[1], "alice")  # and under alice's key the rewritten name fails
    node.close()
    other.close()


def test_every_single_bit_flip_of_a_stored_blob_is_refused(
    location: Location, pg_catalog_url: str
) -> None:
    """Exhaustive over the blob's header and metadata bits, and a stride over its sealed bytes
    (each sealed bit is covered by GCM's tag; the codec test flips every bit of a small blob)."""
    node = open_node(location.kind, location.address, pg_catalog_url)
    key = key_of(7)
    persist(node, "one", [key], "alice")
    raw = location.raw(NS, key)
    store = location.open().store(NS)
    header_end = 8 + int.from_bytes(raw[:8], "little")
    bits = list(range(8 * header_end)) + list(range(8 * header_end, 8 * len(raw), 97))
    for bit in bits:
        damaged = bytearray(raw)
        damaged[bit // 8] ^= 1 << (bit % 8)
        location.plant(NS, key, bytes(damaged))
        out = torch.full((512,), 7, dtype=torch.uint8)
        with pytest.raises((BlobIntegrityError, TenantMismatchError)):
            store.read(key, "alice", out)
        assert bool((out == 7).all()) or bool((out == 0).all()), bit
    location.plant(NS, key, raw)
    assert torch.equal(store.read(key, "alice"), pages([key], "alice")[0])
    node.close()


def test_forget_on_one_node_makes_every_node_load_nothing_of_that_tenant(
    location: Location, pg_catalog_url: str
) -> None:
    a = open_node(location.kind, location.address, pg_catalog_url)
    b = open_node(location.kind, location.address, pg_catalog_url)
    alice, bob = tenant_keys("alice"), tenant_keys("bob")
    persist(a, "alice-ctx", alice, "alice")
    persist(a, "bob-ctx", bob, "bob")
    assert b.longest_prefix(alice, "alice") == 3
    stolen = {k: location.raw(NS, k) for k in alice}  # a copy someone kept of alice's blobs

    report = a.forget("alice")
    assert report.checkpoint_ids == ("alice-ctx",) and report.pages == 3 and report.key_destroyed

    # Node B: no catalog row to offer, no blob to read, no key to open a kept copy with.
    assert b.longest_prefix(alice, "alice") == 0
    assert torch.equal(b.load_prefix(alice, "alice"), torch.empty((0, 0), dtype=torch.uint8))
    assert all(location.raw(NS, k) is None for k in alice)
    store = location.open().store(NS)
    for key, blob in stolen.items():
        location.plant(NS, key, blob)
        with pytest.raises(TenantKeyUnavailableError):
            store.read(key, "alice")
    # Another tenant still hits, on both nodes.
    assert b.longest_prefix(bob, "bob") == 3
    assert torch.equal(b.load("bob-ctx", "bob"), pages(bob, "bob"))
    assert b.forgotten("alice-ctx") is not None and b.forgotten("bob-ctx") is None
    a.close()
    b.close()


def test_a_write_under_way_at_a_forget_is_refused_whatever_the_nodes_clocks_say(
    location: Location, pg_catalog_url: str
) -> None:
    """Node B's clock runs an hour ahead of node A's: its write, leased before A's forget,
    still looks begun after it by B's clock. The catalog ends the write's registration at the
    forget, so it is refused all the same; and it made no key material over the forget's."""
    a = open_node(location.kind, location.address, pg_catalog_url)
    b = open_node(location.kind, location.address, pg_catalog_url, clock=lambda: time.time() + 3600)
    persist(a, "ctx", tenant_keys("alice"), "alice")
    late = [key_of(800 + i) for i in range(3)]
    b.reserve("late", late, "alice")
    worker = location.open().store(NS)
    worker.write_many(late[:2], "alice", pages(late[:2], "alice"))
    a.forget("alice")
    with pytest.raises(TenantKeyUnavailableError, match="forgotten"):  # its last page, after
        worker.write(late[2], "alice", pages(late[2:], "alice")[0])
    worker.write_many(late[2:], "bob", pages(late[2:], "bob"))  # (a blob of the key, to record)
    with pytest.raises(TenantForgottenError):
        b.record_written("late", "alice", late, 512, "agent", "{}", "{}", None)
    assert b.longest_prefix(late, "alice") == 0 and a.longest_prefix(late, "alice") == 0
    a.close()
    b.close()


def test_a_restart_does_not_resurrect_a_forgotten_tenant(
    location: Location, pg_catalog_url: str
) -> None:
    a = open_node(location.kind, location.address, pg_catalog_url)
    keys = tenant_keys("alice")
    persist(a, "ctx", keys, "alice")
    kept = {k: location.raw(NS, k) for k in keys}
    # A write begun before the forget (leased by another node, its blobs written by that node's
    # worker), recorded after it, is refused: its lease ends and its blobs go.
    b = open_node(location.kind, location.address, pg_catalog_url)
    late = [key_of(900 + i) for i in range(2)]
    b.reserve("late", late, "alice")
    location.open().store(NS).write_many(late, "alice", pages(late, "alice"))
    a.forget("alice")
    with pytest.raises(TenantForgottenError):
        b.record_written("late", "alice", late, 512, "agent", "{}", "{}", None)
    assert all(location.raw(NS, k) is None for k in late)
    a.close()
    b.close()
    for key, blob in kept.items():  # even with the old bytes put back
        location.plant(NS, key, blob)

    restarted = open_node(location.kind, location.address, pg_catalog_url)
    assert restarted.longest_prefix(keys, "alice") == 0
    assert restarted.longest_prefix(late, "alice") == 0
    assert restarted.forgotten("ctx") is not None
    store = location.open().store(NS)
    for key in keys:
        with pytest.raises((TenantKeyUnavailableError, BlobMissingError)):
            store.read(key, "alice")
    # The tenant may write again afterwards, under fresh material that opens no old blob.
    fresh = [key_of(950)]
    persist(restarted, "after", fresh, "alice")
    assert torch.equal(restarted.load("after", "alice"), pages(fresh, "alice"))
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        store.read(keys[0], "alice")
    restarted.close()


def test_no_key_material_appears_in_what_the_tier_says(
    location: Location, pg_catalog_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    node = open_node(location.kind, location.address, pg_catalog_url)
    keys = tenant_keys("alice")
    persist(node, "ctx", keys, "alice")
    root = location.open()
    material = root.keys._materials.read_material(root.keys.tenant_id("alice"))
    seal = root.keys.for_read("alice", NS)
    secrets = [material.hex(), seal.key.hex(), root.keys._root.hex()]
    kept = location.raw(NS, keys[0])
    said = [
        repr(root.keys),
        repr(seal),
        node.describe(),
        repr(node.forget("alice")),
        repr(CheckpointCatalog(url=pg_catalog_url).forgotten("ctx")),
    ]
    location.plant(NS, keys[0], kept)
    with pytest.raises(TenantKeyUnavailableError) as refused:
        root.store(NS).read(keys[0], "alice")
    said.append(str(refused.value))
    said.extend(r.getMessage() for r in caplog.records)
    for text in said:
        for secret in secrets:
            assert secret not in text and secret[:16] not in text
    node.close()
