"""CheckpointCatalog: records, tenancy, prefixes, retention, the disk bound and leases, on real
SQLite and on a real PostgreSQL server (every test taking ``catalog`` runs on both)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import stat
from pathlib import Path

import pytest
from disk_support import T0, Clock, key
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.disk.records import KVCheckpointRecord, PageId, PageRef
from kvci_plugin.tiering.disk.schema import MIGRATIONS
from kvci_plugin.tiering.types import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    TenantMismatchError,
)

NS = hashlib.sha256(b"namespace").digest()
PAGE = 4480


def record(
    checkpoint_id: str,
    keys: list[bytes],
    tenant: str = "alice",
    created: float = T0,
    retention_expiry: float | None = None,
    nbytes: int = PAGE,
) -> KVCheckpointRecord:
    return KVCheckpointRecord(
        checkpoint_id=checkpoint_id,
        tenant=tenant,
        namespace=NS.hex(),
        trigger="agent",
        recommendation_json=json.dumps({"score": 0.8, "tier": "disk"}),
        decision_json=json.dumps({"permitted": True, "checks": ["verified_authority"]}),
        created=created,
        retention_expiry=retention_expiry,
        last_used=created,
        slot_bytes=4096,
        pages=tuple(PageRef(key=k.hex(), nbytes=nbytes) for k in keys),
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> CheckpointCatalog:
    if request.param == "sqlite":
        opened = CheckpointCatalog(tmp_path / "catalog.sqlite3", clock)
    else:
        opened = CheckpointCatalog(clock=clock, url=request.getfixturevalue("pg_catalog_url"))
    yield opened
    opened.close()


def rows(path: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(sql).fetchall()


def query(catalog: CheckpointCatalog, sql: str) -> list[tuple]:
    """Rows of ``sql`` run on the catalog's own database, whichever it is."""
    with catalog.locked() as db:
        return [tuple(row.values()) for row in db.execute(sql).fetchall()]


# ---- the record ---------------------------------------------------------------------------

hex_keys = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=8, unique=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    checkpoint_id=st.text(min_size=1, max_size=40),
    tenant=st.text(min_size=1, max_size=20),
    trigger=st.sampled_from(["user", "agent", "system"]),
    recommendation=json_values,
    decision=json_values,
    created=st.floats(min_value=0, max_value=4e9),
    lifetime=st.none() | st.floats(min_value=1, max_value=1e9),
    keys=hex_keys,
    sizes=st.lists(st.integers(min_value=1, max_value=1 << 30), min_size=8, max_size=8),
)
def test_record_round_trips_through_json(
    checkpoint_id: str,
    tenant: str,
    trigger: str,
    recommendation: object,
    decision: object,
    created: float,
    lifetime: float | None,
    keys: list[bytes],
    sizes: list[int],
) -> None:
    rec = KVCheckpointRecord(
        checkpoint_id=checkpoint_id,
        tenant=tenant,
        namespace=NS.hex(),
        trigger=trigger,
        recommendation_json=json.dumps(recommendation),
        decision_json=json.dumps(decision),
        created=created,
        retention_expiry=None if lifetime is None else created + lifetime,
        last_used=created,
        slot_bytes=4096,
        pages=tuple(PageRef(key=k.hex(), nbytes=n) for k, n in zip(keys, sizes)),
    )
    again = KVCheckpointRecord.model_validate_json(rec.model_dump_json())
    assert again == rec
    assert again.page_keys == tuple(keys)
    assert again.nbytes == sum(sizes[: len(keys)])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"namespace": "ab" * 16}, "namespace"),
        ({"trigger": "operator"}, "trigger"),
        ({"decision_json": "{not json"}, "JSON"),
        ({"retention_expiry": T0 - 1}, "retention_expiry"),
        ({"last_used": T0 - 1}, "last_used"),
        ({"pages": ()}, "pages"),
        ({"pages": (PageRef(key=key("a").hex(), nbytes=1),) * 2}, "twice"),
        ({"checkpoint_id": ""}, "checkpoint_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_record_rejects_bad_fields(change: dict, message: str) -> None:
    fields = record("c", [key("a")]).model_dump()
    fields.update(change)
    with pytest.raises(ValidationError, match=message):
        KVCheckpointRecord(**fields)
    with pytest.raises(ValidationError, match="key"):
        PageRef(key="XYZ", nbytes=1)


# ---- the file -----------------------------------------------------------------------------


def test_schema_wal_permissions_and_reopen(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "catalog.sqlite3"
    catalog = CheckpointCatalog(path, clock)
    catalog.add_checkpoint(record("c1", [key("a")]))
    assert catalog.schema_version() == len(MIGRATIONS)
    assert rows(path, "PRAGMA journal_mode") == [("wal",)]
    for name in ("catalog.sqlite3", "catalog.sqlite3-wal", "catalog.sqlite3-shm"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    catalog.close()

    reopened = CheckpointCatalog(path, clock)
    assert reopened.get("c1", "alice") == record("c1", [key("a")])
    assert rows(path, "PRAGMA integrity_check") == [("ok",)]


def test_a_newer_schema_is_refused(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "catalog.sqlite3"
    CheckpointCatalog(path, clock).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS) + 1,))
    with pytest.raises(RuntimeError, match="newer"):
        CheckpointCatalog(path, clock)


# ---- tenancy and lookups ------------------------------------------------------------------


def test_get_refuses_another_tenant_and_unknown_ids(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a")]))
    with pytest.raises(TenantMismatchError) as refused:
        catalog.get("c1", "bob")
    assert "alice" not in str(refused.value)
    with pytest.raises(CheckpointNotFoundError):
        catalog.get("nope", "alice")
    assert catalog.find("c1") == catalog.get("c1", "alice")
    assert catalog.find("nope") is None


def test_expired_checkpoints_are_invisible_before_collection(
    catalog: CheckpointCatalog, clock: Clock
) -> None:
    catalog.add_checkpoint(record("c1", [key("a")], retention_expiry=T0 + 10))
    assert catalog.longest_prefix(NS, [key("a")], "alice") == 1
    clock.now = T0 + 10
    with pytest.raises(CheckpointNotFoundError):
        catalog.get("c1", "alice")
    assert catalog.longest_prefix(NS, [key("a")], "alice") == 0
    assert catalog.find("c1") is not None  # explain still answers until collected


def test_longest_prefix_counts_leading_pages_of_the_tenant_only(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b"), key("c")]))
    catalog.add_checkpoint(record("c2", [key("x")], tenant="bob"))
    assert catalog.longest_prefix(NS, [key("a"), key("b"), key("c"), key("d")], "alice") == 3
    assert catalog.longest_prefix(NS, [key("a"), key("z"), key("c")], "alice") == 1
    assert catalog.longest_prefix(NS, [key("b"), key("c")], "alice") == 2
    assert catalog.longest_prefix(NS, [key("a")], "bob") == 0
    assert catalog.longest_prefix(NS, [key("x")], "alice") == 0
    assert catalog.longest_prefix(hashlib.sha256(b"other").digest(), [key("a")], "alice") == 0
    assert catalog.longest_prefix(NS, [], "alice") == 0


def test_longest_prefix_over_many_keys_spans_query_chunks(catalog: CheckpointCatalog) -> None:
    keys = [key(f"k{i}") for i in range(1203)]
    catalog.add_checkpoint(record("c1", keys[:1100]))
    assert catalog.longest_prefix(NS, keys, "alice") == 1100


def test_lookups_change_nothing(catalog: CheckpointCatalog, clock: Clock) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b")]))
    everything = "SELECT * FROM pages ORDER BY key"
    dump = query(catalog, everything) + query(catalog, "SELECT * FROM checkpoints")
    clock.now = T0 + 100
    catalog.longest_prefix(NS, [key("a"), key("b")], "alice")
    catalog.get("c1", "alice")
    catalog.list()
    catalog.stats()
    assert query(catalog, everything) + query(catalog, "SELECT * FROM checkpoints") == dump


def test_list_by_tenant(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c2", [key("a")], created=T0 + 1))
    catalog.add_checkpoint(record("c1", [key("b")]))
    catalog.add_checkpoint(record("c3", [key("c")], tenant="bob", created=T0 + 2))
    assert [r.checkpoint_id for r in catalog.list()] == ["c1", "c2", "c3"]
    assert [r.checkpoint_id for r in catalog.list("alice")] == ["c1", "c2"]
    assert catalog.list("carol") == []


# ---- writes -------------------------------------------------------------------------------


def test_a_shared_page_is_stored_once(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b")]))
    catalog.add_checkpoint(record("c2", [key("a"), key("b"), key("c")]))
    stats = catalog.stats()
    assert (stats.checkpoints, stats.pages, stats.bytes_used) == (2, 3, 3 * PAGE)
    assert [page.key for page in catalog.get("c2", "alice").pages] == [
        key(n).hex() for n in "abc"
    ]


def test_a_page_of_another_tenant_refuses_the_whole_record(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("shared")], tenant="bob"))
    with pytest.raises(TenantMismatchError):
        catalog.add_checkpoint(record("c2", [key("mine"), key("shared")]))
    assert catalog.find("c2") is None
    assert catalog.held_pages(NS, [key("mine"), key("shared")]) == {key("shared")}
    # The refused record left no row behind, in any table.
    assert query(catalog, "SELECT key FROM pages") == [(key("shared").hex(),)]
    assert query(catalog, "SELECT count(*) FROM checkpoint_pages") == [(1,)]


def test_duplicate_ids_and_past_expiry_are_refused(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a")]))
    with pytest.raises(CheckpointExistsError):
        catalog.add_checkpoint(record("c1", [key("b")]))
    with pytest.raises(ValueError, match="retention_expiry"):
        catalog.add_checkpoint(record("c2", [key("b")], created=T0 - 10, retention_expiry=T0))
    assert catalog.held_pages(NS, [key("b")]) == set()


def test_touch_marks_pages_and_their_checkpoints(catalog: CheckpointCatalog, clock: Clock) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b")]))
    catalog.add_checkpoint(record("c2", [key("c")]))
    clock.now = T0 + 5
    catalog.touch(NS, [key("b")])
    assert catalog.get("c1", "alice").last_used == T0 + 5
    assert catalog.get("c2", "alice").last_used == T0


def test_remove_forgets_the_pages_no_one_else_holds(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b")]))
    catalog.add_checkpoint(record("c2", [key("a"), key("c")]))
    removal = catalog.remove("c1")
    assert removal.checkpoint_ids == ("c1",)
    assert removal.pages == (PageId(NS, key("b")),)
    assert catalog.held_pages(NS, [key("a"), key("b"), key("c")]) == {key("a"), key("c")}
    with pytest.raises(CheckpointNotFoundError):
        catalog.remove("c1")


def test_drop_pages_takes_the_checkpoints_that_need_them(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b")]))
    catalog.add_checkpoint(record("c2", [key("c")]))
    removal = catalog.drop_pages([PageId(NS, key("b"))])
    assert removal.checkpoint_ids == ("c1",)
    assert removal.pages == (PageId(NS, key("b")),)
    assert catalog.unreferenced_pages() == [PageId(NS, key("a"))]
    assert catalog.longest_prefix(NS, [key("a")], "alice") == 1  # still a prefix cache
    assert [r.checkpoint_id for r in catalog.list()] == ["c2"]


# ---- retention ----------------------------------------------------------------------------


def test_gc_expired_removes_checkpoints_and_their_expired_pages(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("short", [key("a"), key("b")], retention_expiry=T0 + 10))
    catalog.add_checkpoint(record("long", [key("b"), key("c")], retention_expiry=T0 + 100))
    catalog.add_checkpoint(record("forever", [key("d")]))

    assert catalog.gc_expired(T0 + 9).checkpoint_ids == ()
    removal = catalog.gc_expired(T0 + 10)
    assert removal.checkpoint_ids == ("short",)
    # b stays: "long" holds it and was permitted to keep it longer.
    assert removal.pages == (PageId(NS, key("a")),)
    removal = catalog.gc_expired(T0 + 1000)
    assert removal.checkpoint_ids == ("long",)
    assert set(removal.pages) == {PageId(NS, key("b")), PageId(NS, key("c"))}
    assert [r.checkpoint_id for r in catalog.list()] == ["forever"]


def test_a_page_keeps_the_longest_retention_it_was_granted(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("long", [key("a")], retention_expiry=T0 + 100))
    catalog.add_checkpoint(record("short", [key("a")], retention_expiry=T0 + 10))
    catalog.remove("long")  # "short" still holds a
    assert catalog.gc_expired(T0 + 50).checkpoint_ids == ("short",)
    # Unreferenced now, but permitted until T0 + 100 by "long".
    assert catalog.unreferenced_pages() == [PageId(NS, key("a"))]
    assert catalog.gc_expired(T0 + 100).pages == (PageId(NS, key("a")),)


# ---- the bound ----------------------------------------------------------------------------


def test_unreferenced_pages_go_first_then_lru_checkpoints(
    catalog: CheckpointCatalog, clock: Clock
) -> None:
    catalog.add_checkpoint(record("old", [key("o1"), key("o2")]))
    clock.now = T0 + 1
    catalog.add_checkpoint(record("mid", [key("m1"), key("m2")], created=T0 + 1))
    clock.now = T0 + 2
    catalog.add_checkpoint(record("new", [key("n1"), key("loose")], created=T0 + 2))
    catalog.drop_pages([PageId(NS, key("n1"))])  # leaves "loose", the most recently used page
    assert catalog.stats().bytes_used == 5 * PAGE

    removal = catalog.evict_to(4 * PAGE)
    assert removal.checkpoint_ids == ()
    assert removal.pages == (PageId(NS, key("loose")),)

    clock.now = T0 + 3
    catalog.touch(NS, [key("o1")])  # "old" is now the most recently used checkpoint
    removal = catalog.evict_to(3 * PAGE)
    assert removal.checkpoint_ids == ("mid",)
    # Only as many of mid's pages as needed; the other stays as an unreferenced page.
    assert len(removal.pages) == 1 and removal.pages[0].key in {key("m1"), key("m2")}
    assert catalog.stats().bytes_used == 3 * PAGE
    assert catalog.get("old", "alice").page_keys == (key("o1"), key("o2"))

    assert catalog.evict_to(0).checkpoint_ids == ("old",)
    assert catalog.stats() == type(catalog.stats())(0, 0, 0, 0, 0)


@settings(max_examples=40, deadline=None)
@given(
    plan=st.lists(
        st.tuples(
            st.lists(st.integers(min_value=0, max_value=11), min_size=1, max_size=4, unique=True),
            st.lists(st.integers(min_value=0, max_value=11), max_size=3),
        ),
        min_size=1,
        max_size=8,
    ),
    dropped=st.lists(st.integers(min_value=0, max_value=11), max_size=2),
    bound_pages=st.integers(min_value=0, max_value=12),
)
def test_evict_to_meets_the_bound_and_keeps_survivors_whole(
    tmp_path_factory: pytest.TempPathFactory,
    plan: list[tuple[list[int], list[int]]],
    dropped: list[int],
    bound_pages: int,
) -> None:
    clock = Clock()
    catalog = CheckpointCatalog(tmp_path_factory.mktemp("c") / "catalog.sqlite3", clock)
    for i, (pages, touched) in enumerate(plan):
        clock.now = T0 + 2 * i
        catalog.add_checkpoint(record(f"c{i}", [key(str(p)) for p in pages], created=clock.now))
        clock.now += 1
        catalog.touch(NS, [key(str(p)) for p in touched])
    catalog.drop_pages([PageId(NS, key(str(p))) for p in dropped])
    before = {r.checkpoint_id: r for r in catalog.list()}
    loose = set(catalog.unreferenced_pages())
    bound = bound_pages * PAGE

    removal = catalog.evict_to(bound)

    after = {r.checkpoint_id: r for r in catalog.list()}
    used = catalog.stats().bytes_used
    assert used <= bound
    assert set(before) - set(after) == set(removal.checkpoint_ids)
    kept_keys = {k for rec in after.values() for k in rec.page_keys}
    assert not {page.key for page in removal.pages} & kept_keys
    # Survivors are whole, and were used no earlier than any evicted checkpoint.
    for rec in after.values():
        assert rec == before[rec.checkpoint_id]
        assert all(rec.last_used >= before[c].last_used for c in removal.checkpoint_ids)
    if removal.checkpoint_ids:
        # Whole checkpoints went only once every page no checkpoint held had gone, and no more
        # was evicted than the bound needed.
        assert loose <= set(removal.pages)
        assert used > bound - PAGE
    catalog.close()


# ---- leases and shards --------------------------------------------------------------------


def test_a_tenant_past_its_fair_share_of_the_disk_evicts_its_own_checkpoints_first(
    catalog: CheckpointCatalog
) -> None:
    """One global LRU let any tenant with kv:persist evict everyone's durable checkpoints: the
    oldest checkpoints here are acme's, yet mallory's writes take mallory's own."""
    catalog.add_checkpoint(record("acme1", [key("a1")], tenant="acme", created=T0))
    catalog.add_checkpoint(record("acme2", [key("a2")], tenant="acme", created=T0 + 1))
    for i in range(6):
        catalog.add_checkpoint(record(f"m{i}", [key(f"m{i}")], tenant="mallory",
                                      created=T0 + 10 + i))
        removal = catalog.evict_to(4 * PAGE, protect=f"m{i}")
        assert not {"acme1", "acme2"} & set(removal.checkpoint_ids)
    assert catalog.tenant_bytes() == {"acme": 2 * PAGE, "mallory": 2 * PAGE}
    # The share holds both ways: acme's own write takes acme past its share, and acme's oldest
    # goes, not mallory's (older than acme's newest).
    catalog.add_checkpoint(record("acme3", [key("a3")], tenant="acme", created=T0 + 20))
    assert catalog.evict_to(4 * PAGE, protect="acme3").checkpoint_ids == ("acme1",)


def test_leased_pages_are_never_evicted_nor_handed_back_for_deletion(
    catalog: CheckpointCatalog, clock: Clock
) -> None:
    catalog.add_checkpoint(record("old", [key("a"), key("b"), key("x")]))
    catalog.add_checkpoint(record("c1", [key("c")], created=T0 + 1))
    # "a" and "b" become unreferenced; another node leases "a" to reuse its blob.
    catalog.drop_pages([PageId(NS, key("x"))])
    catalog.lease(NS, [key("a")], "writer", until=T0 + 60, tenant="alice")
    assert catalog.leased(NS, [key("a"), key("b")]) == {key("a")}
    assert catalog.leased(NS, [key("a")], holder="writer") == set()

    removal = catalog.evict_to(0)
    assert {p.key for p in removal.pages} == {key("b"), key("c")}
    assert key("a") in catalog.held_pages(NS, [key("a")])

    # drop_pages forgets the row of a leased page but leaves its blob to the lease holder.
    assert catalog.drop_pages([PageId(NS, key("a"))]).pages == ()
    assert catalog.held_pages(NS, [key("a")]) == set()

    # A lease ends with its holder's checkpoint, or when it expires.
    catalog.lease(NS, [key("d")], "w2", until=T0 + 60, tenant="alice")
    catalog.add_checkpoint(record("w2", [key("d")]), holder="w2")
    assert catalog.leased(NS, [key("d")]) == set()
    clock.now = T0 + 61
    assert catalog.leased(NS, [key("a")]) == set()
    assert catalog.live_leases() == set()


def test_removed_pages_under_lease_keep_their_blobs(catalog: CheckpointCatalog) -> None:
    catalog.add_checkpoint(record("c1", [key("a"), key("b")], retention_expiry=T0 + 5))
    catalog.lease(NS, [key("b")], "writer", until=T0 + 60, tenant="alice")
    assert {p.key for p in catalog.remove("c1").pages} == {key("a")}
    catalog.add_checkpoint(record("c2", [key("e")], retention_expiry=T0 + 5))
    catalog.lease(NS, [key("e")], "writer", until=T0 + 60, tenant="alice")
    removal = catalog.gc_expired(T0 + 10)
    assert removal.checkpoint_ids == ("c2",)
    assert removal.pages == ()  # "e" is leased: its row stays for the writer to re-record
    catalog.release("writer")
    assert {p.key for p in catalog.gc_expired(T0 + 10).pages} == {key("e")}


def test_shards_are_recorded_once(catalog: CheckpointCatalog) -> None:
    s1, s2 = hashlib.sha256(b"rank1").digest(), hashlib.sha256(b"rank2").digest()
    catalog.register_shards(NS, [s1, s2])
    catalog.register_shards(NS, [s2])
    assert catalog.shards() == {NS: tuple(sorted([s1, s2], key=bytes.hex))}


def test_postgres_schema_matches_sqlite(tmp_path: Path, pg_catalog_url: str) -> None:
    """The same tables and columns on both, with types as wide as SQLite's."""
    lite = CheckpointCatalog(tmp_path / "catalog.sqlite3")
    pg = CheckpointCatalog(url=pg_catalog_url)
    assert lite.schema_version() == pg.schema_version() == len(MIGRATIONS)
    tables = [t for (t,) in rows(tmp_path / "catalog.sqlite3",
                                 "SELECT name FROM sqlite_master WHERE type = 'table'")]
    for table in tables:
        info = rows(tmp_path / "catalog.sqlite3", f"PRAGMA table_info({table})")
        lite_columns = [r[1] for r in info]
        pg_columns = query(
            pg,
            "SELECT column_name, data_type FROM information_schema.columns"
            f" WHERE table_name = '{table}' ORDER BY ordinal_position",
        )
        assert [c for c, _ in pg_columns] == lite_columns, table
        assert {t for _, t in pg_columns} <= {"text", "bigint", "double precision"}, table
    pg.close()
    lite.close()


def test_a_version_1_catalog_migrates_in_place(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite3"
    with sqlite3.connect(path) as db:  # a catalog as the first release wrote it
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for statement in MIGRATIONS[0]:
            db.execute(statement)
        db.execute("INSERT INTO schema_version (version) VALUES (1)")
    catalog = CheckpointCatalog(path)
    assert catalog.schema_version() == len(MIGRATIONS) == 6
    assert catalog.generation(NS) == 0
    catalog.lease(NS, [key("a")], "w", until=4e9, tenant="alice")
    assert catalog.leased(NS, [key("a")]) == {key("a")}
    catalog.close()


def test_a_reset_fences_a_namespace_for_every_node_and_later_resets_join(
    catalog: CheckpointCatalog,
) -> None:
    from kvci_plugin.tiering.keys import generation_namespace

    gen1 = generation_namespace(NS, 1)
    catalog.add_checkpoint(record("old", [key("a"), key("b")]))
    assert catalog.generation(NS) == 0
    new, removal = catalog.advance_generation(NS, 0, NS)
    assert new == catalog.generation(NS) == 1
    assert removal.checkpoint_ids == ("old",) and {p.key for p in removal.pages} == {
        key("a"),
        key("b"),
    }
    assert catalog.find("old") is None and catalog.longest_prefix(NS, [key("a")], "alice") == 0
    tenant, _, generation = catalog.fenced("old")
    assert (tenant, generation) == ("alice", 1)
    assert catalog.fenced("never-held") is None
    # A node still in generation 0 that resets joins generation 1 (fencing what it kept since);
    # a node in generation 1 moves everyone on to 2.
    assert catalog.advance_generation(NS, 0, NS)[0] == 1
    assert catalog.advance_generation(NS, 1, gen1)[0] == 2
    assert generation_namespace(NS, 0) == NS and len({NS, gen1, generation_namespace(NS, 2)}) == 3
