"""KVCheckpointStore: the disk tier end to end on real files and real SQLite."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
import torch
from disk_support import T0, Clock, key
from support.disk_tier import DiskTierForTests

from kvci_plugin.tiering.blobs.errors import BlobIntegrityError, BlobMissingError
from kvci_plugin.tiering.blobs.folder import BlobStore
from kvci_plugin.tiering.disk.tier import CATALOG_NAME, TOUCH_FLUSH_S
from kvci_plugin.tiering.types import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DoesNotFitError,
    TenantMismatchError,
)

NS = hashlib.sha256(b"model=tiny;rev=1;dtype=bf16;block=32;tp=0/1").digest()
NEW_NS = hashlib.sha256(b"model=tiny;rev=2;dtype=bf16;block=32;tp=0/1").digest()
SLOT = 4096
ROOMY = 1 << 20


def pages_of(keys: list[bytes]) -> torch.Tensor:
    return torch.stack(
        [
            torch.frombuffer(bytearray(hashlib.shake_128(k).digest(SLOT)), dtype=torch.uint8)
            for k in keys
        ]
    )


def persist(
    store: DiskTierForTests,
    checkpoint_id: str,
    names: str,
    tenant: str = "alice",
    retention_expiry: float | None = None,
):
    keys = [key(f"{tenant}/{n}") for n in names]
    return store.persist(
        checkpoint_id,
        tenant,
        keys,
        pages_of(keys),
        trigger="user",
        recommendation_json=json.dumps({"score": 0.9, "tier": "disk"}),
        decision_json=json.dumps({"permitted": True, "derivation": {"retention": "30d"}}),
        retention_expiry=retention_expiry,
    )


def keys_of(names: str, tenant: str = "alice") -> list[bytes]:
    return [key(f"{tenant}/{n}") for n in names]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock):
    with DiskTierForTests(tmp_path / "kv", NS, ROOMY, clock) as opened:
        yield opened


def test_persist_load_and_explain(store: DiskTierForTests) -> None:
    record = persist(store, "c1", "abc")
    assert torch.equal(store.load("c1", "alice"), pages_of(keys_of("abc")))
    assert store.explain("c1") == record
    assert record.page_keys == tuple(keys_of("abc"))
    assert record.trigger == "user"
    assert json.loads(record.decision_json)["derivation"] == {"retention": "30d"}
    stats = store.stats()
    assert (stats.checkpoints, stats.pages, stats.bytes_used) == (1, 3, record.nbytes)
    assert record.nbytes > 3 * SLOT  # headers are counted against the bound
    assert store.list("alice") == [record]
    assert store.list("bob") == []


def test_a_cross_tenant_load_of_a_valid_id_is_refused(store: DiskTierForTests) -> None:
    persist(store, "c1", "abc")
    with pytest.raises(TenantMismatchError):
        store.load("c1", "bob")
    assert store.longest_prefix(keys_of("abc"), "bob") == 0
    assert store.load_prefix(keys_of("abc"), "bob").shape == (0, 0)
    assert torch.equal(store.load("c1", "alice"), pages_of(keys_of("abc")))


def test_a_flipped_byte_is_never_loaded_and_the_record_is_dropped(
    store: DiskTierForTests,
) -> None:
    persist(store, "c1", "abc")
    persist(store, "c2", "ab")
    path = BlobStore(store.root, NS).path_for(keys_of("abc")[1])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))

    with pytest.raises(BlobIntegrityError):
        store.load("c1", "alice")

    # Both checkpoints needed page b: both are gone; page a stays as an unreferenced page.
    assert store.explain("c1") is None and store.explain("c2") is None
    assert store.longest_prefix(keys_of("abc"), "alice") == 1
    stats = store.stats()
    assert (stats.checkpoints, stats.unreferenced_pages, stats.quarantined) == (0, 2, 1)
    with pytest.raises(CheckpointNotFoundError):
        store.load("c2", "alice")


def test_load_prefix_stops_at_a_bad_page(store: DiskTierForTests) -> None:
    persist(store, "c1", "abcd")
    BlobStore(store.root, NS).path_for(keys_of("abcd")[2]).write_bytes(b"torn")
    loaded = store.load_prefix(keys_of("abcdz"), "alice")
    assert torch.equal(loaded, pages_of(keys_of("ab")))
    assert store.longest_prefix(keys_of("abcd"), "alice") == 2


def test_restart_finds_every_durable_checkpoint_that_has_not_expired(
    tmp_path: Path, clock: Clock
) -> None:
    root = tmp_path / "kv"
    with DiskTierForTests(root, NS, ROOMY, clock) as store:
        persist(store, "forever", "abc")
        persist(store, "long", "abd", retention_expiry=T0 + 100)
        persist(store, "short", "xy", retention_expiry=T0 + 10)
        persist(store, "bobs", "abc", tenant="bob", retention_expiry=T0 + 100)

    with DiskTierForTests(root, NS, ROOMY, Clock(T0 + 50)) as store:
        assert [r.checkpoint_id for r in store.list()] == ["bobs", "forever", "long"]
        assert torch.equal(store.load("forever", "alice"), pages_of(keys_of("abc")))
        assert torch.equal(store.load("long", "alice"), pages_of(keys_of("abd")))
        assert torch.equal(store.load("bobs", "bob"), pages_of(keys_of("abc", "bob")))
        assert store.last_reconcile.expired.checkpoint_ids == ("short",)
        assert not any(BlobStore(root, NS).exists(k) for k in keys_of("xy"))

    with DiskTierForTests(root, NS, ROOMY, Clock(T0 + 100)) as store:
        assert [r.checkpoint_id for r in store.list()] == ["forever"]
        # d was only held by "long"; a, b, c are still needed by "forever".
        assert store.longest_prefix(keys_of("abcd"), "alice") == 3
        assert not BlobStore(root, NS).exists(keys_of("d")[0])


def test_reconcile_removes_temp_and_orphan_blobs_and_drops_lost_pages(
    tmp_path: Path, clock: Clock
) -> None:
    root = tmp_path / "kv"
    with DiskTierForTests(root, NS, ROOMY, clock) as store:
        persist(store, "c1", "ab")
        persist(store, "c2", "cd")
    blobs = BlobStore(root, NS)
    orphan = key("alice/orphan")
    blobs.write(orphan, "alice", pages_of([orphan])[0])  # blob durable, row never added
    temp = blobs.path_for(orphan).parent / ".kvci-interrupted.tmp"
    temp.write_bytes(b"half a blob")
    blobs.delete(keys_of("d")[0])  # a blob vanished behind the catalog's back

    with DiskTierForTests(root, NS, ROOMY, clock) as store:
        report = store.last_reconcile
        assert (report.temp_files, report.orphan_blobs) == (1, 1)
        assert report.lost.checkpoint_ids == ("c2",)
        assert not temp.exists() and not blobs.exists(orphan)
        assert [r.checkpoint_id for r in store.list()] == ["c1"]
        assert torch.equal(store.load("c1", "alice"), pages_of(keys_of("ab")))
        assert store.stats().unreferenced_pages == 1  # c's blob is intact: a prefix cache page

    with sqlite3.connect(root / CATALOG_NAME) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []


def test_disk_bytes_is_a_bound_and_eviction_is_lru(tmp_path: Path, clock: Clock) -> None:
    root = tmp_path / "kv"
    with DiskTierForTests(root, NS, 10 * SLOT, clock) as store:
        persist(store, "c1", "ab")
        clock.now += 1
        persist(store, "c2", "cd")
        clock.now += 1
        store.load("c1", "alice")  # c2 is now the least recently used
        clock.now += 1
        persist(store, "c3", "efgh")
        clock.now += 1
        persist(store, "c4", "ij")
        assert [r.checkpoint_id for r in store.list()] == ["c1", "c3", "c4"]
        assert store.stats().bytes_used <= 10 * SLOT
        on_disk = sum(p.stat().st_size for p in (root / "blobs").rglob("*.safetensors"))
        assert on_disk == store.stats().bytes_used
        assert torch.equal(store.load("c4", "alice"), pages_of(keys_of("ij")))

    # A smaller bound is enforced at start-up too.
    with DiskTierForTests(root, NS, 5 * SLOT, clock) as store:
        assert store.stats().bytes_used <= 5 * SLOT
        assert store.last_reconcile.evicted.checkpoint_ids


def test_a_checkpoint_larger_than_the_disk_is_refused_before_writing(
    tmp_path: Path, clock: Clock
) -> None:
    with DiskTierForTests(tmp_path / "kv", NS, 2 * SLOT, clock) as store:
        with pytest.raises(DoesNotFitError, match="disk_bytes"):
            persist(store, "big", "abc")
        # Fits as payload, not once headers are counted: written, then refused, then cleaned.
        with pytest.raises(DoesNotFitError, match="headers"):
            persist(store, "edge", "ab")
        assert store.stats().pages == 0
        assert not list((tmp_path / "kv" / "blobs").rglob("*.safetensors"))


def test_bad_input_leaves_nothing_on_disk(store: DiskTierForTests) -> None:
    keys = keys_of("ab")
    good = pages_of(keys)
    bad_calls = [
        (dict(decision_json="{not json"), ValueError),
        (dict(trigger="operator"), ValueError),
        (dict(pages=good[:1]), ValueError),
        (dict(pages=good.to(torch.int16)), ValueError),
        (dict(keys=[b"short", keys[1]]), ValueError),
        (dict(keys=[]), ValueError),
        (dict(keys=[keys[0], keys[0]]), ValueError),
        (dict(tenant=""), ValueError),
        (dict(retention_expiry=T0), ValueError),
    ]
    for change, error in bad_calls:
        args = dict(
            checkpoint_id="c1",
            tenant="alice",
            keys=keys,
            pages=good,
            trigger="user",
            recommendation_json="{}",
            decision_json="{}",
            retention_expiry=None,
        )
        args.update(change)
        with pytest.raises(error):
            store.persist(**args)
        assert not list((store.root / "blobs").rglob("*.safetensors")), change
    persist(store, "c1", "ab")
    with pytest.raises(CheckpointExistsError):
        persist(store, "c1", "cd")
    assert store.longest_prefix(keys_of("cd"), "alice") == 0


def test_a_failed_persist_removes_only_the_blobs_it_added(store: DiskTierForTests) -> None:
    persist(store, "c1", "ab")
    # A (vanishingly unlikely) key shared with another tenant's page: refused as a whole.
    stolen = keys_of("b")[0]
    mine = key("bob/new")
    with pytest.raises(TenantMismatchError):
        store.persist(
            "c2", "bob", [mine, stolen], pages_of([mine, stolen]), "user", "{}", "{}", None
        )
    blobs = BlobStore(store.root, NS)
    assert not blobs.exists(mine)
    assert torch.equal(store.load("c1", "alice"), pages_of(keys_of("ab")))


def test_the_folder_is_locked_to_one_store(tmp_path: Path, clock: Clock) -> None:
    root = tmp_path / "kv"
    first = DiskTierForTests(root, NS, ROOMY, clock)
    with pytest.raises(RuntimeError, match="in use"):
        DiskTierForTests(root, NS, ROOMY, clock)
    first.close()
    DiskTierForTests(root, NS, ROOMY, clock).close()


def test_a_new_namespace_never_loads_old_kv(tmp_path: Path, clock: Clock) -> None:
    root = tmp_path / "kv"
    with DiskTierForTests(root, NS, ROOMY, clock) as store:
        persist(store, "c1", "ab")
    with DiskTierForTests(root, NEW_NS, ROOMY, clock) as store:
        assert store.longest_prefix(keys_of("ab"), "alice") == 0
        with pytest.raises(CheckpointNotFoundError, match="namespace"):
            store.load("c1", "alice")
        # The old namespace's blobs are neither orphans nor lost: they still count and age out.
        assert store.last_reconcile.orphan_blobs == 0 and not store.last_reconcile.lost.pages
        assert store.stats().pages == 2


def test_folder_and_file_permissions(store: DiskTierForTests) -> None:
    persist(store, "c1", "ab")
    for path in [store.root, *store.root.rglob("*")]:
        expected = 0o700 if path.is_dir() else 0o600
        assert path.stat().st_mode & 0o777 == expected, path


def test_bad_construction_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_bytes"):
        DiskTierForTests(tmp_path / "a", NS, 0)
    with pytest.raises(TypeError, match="disk_bytes"):
        DiskTierForTests(tmp_path / "b", NS, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        DiskTierForTests(tmp_path / "c", NS[:16], ROOMY)


def test_the_checkpoint_just_written_is_never_its_own_victim(tmp_path: Path, clock: Clock) -> None:
    with DiskTierForTests(tmp_path / "kv", NS, 3 * SLOT, clock) as store:
        persist(store, "z", "ab")
        persist(store, "a", "cd")  # same instant, and "a" sorts first: still "z" goes
        assert [r.checkpoint_id for r in store.list()] == ["a"]
        assert torch.equal(store.load("a", "alice"), pages_of(keys_of("cd")))


def test_record_written_records_blobs_a_worker_wrote(store: DiskTierForTests) -> None:
    worker = BlobStore(store.root, NS)  # the worker process's half, on the same folder
    keys = keys_of("abc")
    store.reserve("c1", keys, "alice")  # the scheduler leases before the worker writes
    sizes = [worker.write(k, "alice", page) for k, page in zip(keys, pages_of(keys))]
    record = store.record_written(
        "c1", "alice", keys, SLOT, "agent", "{}", json.dumps({"permitted": True}), None
    )
    assert [page.nbytes for page in record.pages] == sizes
    assert store.stats().bytes_used == sum(sizes)
    assert torch.equal(store.load("c1", "alice"), pages_of(keys))


def test_record_written_refuses_a_missing_blob_and_cleans_up(store: DiskTierForTests) -> None:
    worker = BlobStore(store.root, NS)
    persist(store, "held", "a")
    keys = keys_of("abc")
    worker.write(keys[2], "alice", pages_of(keys)[2])  # b never arrived
    with pytest.raises(BlobMissingError):
        store.record_written("c1", "alice", keys, SLOT, "agent", "{}", "{}", None)
    assert store.explain("c1") is None
    assert not worker.exists(keys[2])  # would be an orphan: gone now, not at the next start
    assert worker.exists(keys[0])  # held by "held"
    assert torch.equal(store.load("held", "alice"), pages_of(keys[:1]))


def test_touch_keeps_pages_in_use_from_eviction(tmp_path: Path, clock: Clock) -> None:
    with DiskTierForTests(tmp_path / "kv", NS, 5 * SLOT, clock) as store:
        persist(store, "c1", "ab")
        clock.now += 1
        persist(store, "c2", "cd")
        clock.now += 1
        store.touch(keys_of("a"))  # a disk load of c1's first page was scheduled
        clock.now += 1
        persist(store, "c3", "e")
        assert [r.checkpoint_id for r in store.list()] == ["c1", "c3"]


def test_a_touch_reaches_the_catalog_within_the_flush_interval(tmp_path: Path,
                                                                 clock: Clock) -> None:
    with DiskTierForTests(tmp_path / "kv", NS, ROOMY, clock) as store:
        persist(store, "c1", "ab")
        created = store.explain("c1").last_used
        clock.now += 5
        store.touch(keys_of("a"))  # on the hit's path: no catalog write yet
        assert store.explain("c1").last_used == created
        clock.now += TOUCH_FLUSH_S / 2
        store.touch(keys_of("b"))
        assert store.explain("c1").last_used == created
        clock.now += TOUCH_FLUSH_S / 2
        store.touch(keys_of("b"))  # the first pending touch is now due: all are recorded
        assert store.explain("c1").last_used == clock.now
        clock.now += 3
        store.touch(keys_of("a"))
    with DiskTierForTests(tmp_path / "kv", NS, ROOMY, clock) as store:
        assert store.explain("c1").last_used == clock.now  # closing recorded the last touch


def test_a_copy_of_key_material_a_killed_writer_left_is_swept_at_start(tmp_path: Path) -> None:
    """Material is written to a temp file and linked into place; a process killed between the
    link and the unlink leaves the temp file: a second copy of the key nothing else removes."""
    with DiskTierForTests(tmp_path / "kv", NS, ROOMY) as first:
        persist(first, "c1", "ab")
    (material,) = (tmp_path / "kv" / "keys").glob("*.key")
    left = material.with_name(f".{material.name}.4242.0123456789abcdef")
    left.write_bytes(material.read_bytes())
    with DiskTierForTests(tmp_path / "kv", NS, ROOMY) as again:
        assert again.last_reconcile.temp_files >= 1
        assert torch.equal(again.load("c1", "alice"), pages_of(keys_of("ab")))
    assert not left.exists() and material.exists()
