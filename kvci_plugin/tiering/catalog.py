"""CheckpointCatalog: the durable record of the disk tier, scheduler side.

Embedded SQLite (WAL) by default; PostgreSQL (``catalog_url``) when several nodes share the
tier. The same schema, migrations and SQL run on both (``catalog_db``).

Three tables: ``checkpoints`` (one row per KVCheckpointRecord with its full provenance),
``pages`` (one row per blob, shared pages once) and ``checkpoint_pages`` (the ordered page list
of each checkpoint). The catalog never touches blob files: every call that drops pages returns
them in a ``Removal`` so that the owner of the blobs deletes the files after the rows are gone.
The order is what keeps the two consistent across a crash: blobs are durable before their rows
are added, and rows are gone before their blobs are deleted, so a crash leaves at worst orphan
blobs, which start-up reconciliation removes.

Retention. A page row keeps the most permissive retention expiry among the checkpoints that
added it (NULL = no limit): each of them was permitted that long for the same bytes, so a live
checkpoint's pages never expire before it does. Expired checkpoints and pages are invisible to
lookups before garbage collection removes them.

Eviction (``evict_to``). Pages no live checkpoint references (left behind when their
checkpoint was evicted or lost a page) are a prefix cache: they go first, least recently used
first. If the pages of live checkpoints alone exceed the bound, whole checkpoints go, least
recently used first, and their now-unreferenced pages then join the LRU. Dropping whole
checkpoints keeps every remaining record fully loadable; a bound that pinned records could
overrun would not be a bound.

Leases. A writer leases the pages it is about to write (``lease``) before touching a blob and
gives the lease up when its checkpoint is recorded (``add_checkpoint(holder=...)``) or has
failed (``release``). No call that removes page rows hands back a page under a live lease for
deletion, and eviction never chooses one, so a node's eviction or retention GC cannot delete a
blob another node has just written or decided to reuse. A writer that dies leaves its lease to
expire. Removals run in write transactions; the caller deletes the blobs once the removal has
committed, outside the lock (a slow blob store must hold up no node's catalog writes), skipping
pages leased or recorded again since. A write that leases a page in the short window before its
blob's deletion loses the blob: a miss, never wrong KV (every blob is verified when loaded).

Shards. Under tensor parallelism each rank writes its part of a page into its own namespace;
the catalog records one page per key under the first rank's namespace and maps that namespace
to every rank's (``register_shards``), so whoever removes a page removes every shard's blob.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvci_plugin.tiering.blob_codec import check_namespace
from kvci_plugin.tiering.catalog_db import (
    CatalogDatabase,
    Dialect,
    Row,
    Transaction,
    open_catalog_database,
)
from kvci_plugin.tiering.timeouts import DependencyTimeouts
from kvci_plugin.tiering.types import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    TenantForgottenError,
    PageKey,
    TenantMismatchError,
    check_checkpoint_id,
    check_page_key,
    check_tenant,
)

_HEX_KEY = r"^[0-9a-f]{32}$"
_HEX_NAMESPACE = r"^[0-9a-f]{64}$"
# Keeps each IN (...) list well under SQLite's bound on host parameters.
_CHUNK = 500
FENCED_GENERATIONS_KEPT = 16
"""Generations whose fenced checkpoints explain still names (older tombstones are deleted)."""

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE checkpoints (
            checkpoint_id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            namespace TEXT NOT NULL,
            trigger TEXT NOT NULL,
            recommendation_json TEXT NOT NULL,
            decision_json TEXT NOT NULL,
            created REAL NOT NULL,
            retention_expiry REAL,
            slot_bytes INTEGER NOT NULL,
            bytes INTEGER NOT NULL,
            last_used REAL NOT NULL,
            page_count INTEGER NOT NULL
        )""",
        """CREATE TABLE pages (
            namespace TEXT NOT NULL,
            key TEXT NOT NULL,
            tenant TEXT NOT NULL,
            bytes INTEGER NOT NULL,
            last_used REAL NOT NULL,
            retention_expiry REAL,
            PRIMARY KEY (namespace, key)
        ) WITHOUT ROWID""",
        """CREATE TABLE checkpoint_pages (
            checkpoint_id TEXT NOT NULL
                REFERENCES checkpoints (checkpoint_id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            namespace TEXT NOT NULL,
            key TEXT NOT NULL,
            PRIMARY KEY (checkpoint_id, position),
            FOREIGN KEY (namespace, key) REFERENCES pages (namespace, key)
        ) WITHOUT ROWID""",
        "CREATE INDEX checkpoint_pages_by_page ON checkpoint_pages (namespace, key)",
        "CREATE INDEX checkpoints_by_tenant ON checkpoints (tenant)",
        "CREATE INDEX checkpoints_by_expiry ON checkpoints (retention_expiry)",
        "CREATE INDEX checkpoints_by_last_used ON checkpoints (last_used)",
        "CREATE INDEX pages_by_last_used ON pages (last_used)",
    ),
    (
        """CREATE TABLE blob_leases (
            namespace TEXT NOT NULL,
            key TEXT NOT NULL,
            holder TEXT NOT NULL,
            expiry REAL NOT NULL,
            PRIMARY KEY (namespace, key, holder)
        ) WITHOUT ROWID""",
        "CREATE INDEX blob_leases_by_holder ON blob_leases (holder)",
        """CREATE TABLE namespace_shards (
            namespace TEXT NOT NULL,
            shard TEXT NOT NULL,
            PRIMARY KEY (namespace, shard)
        ) WITHOUT ROWID""",
    ),
    (
        # The generation each engine namespace is in (a cache reset starts the next one), and
        # the checkpoints a reset fenced, kept for explain.
        """CREATE TABLE generations (
            namespace TEXT PRIMARY KEY,
            gen INTEGER NOT NULL,
            reset_at REAL NOT NULL
        ) WITHOUT ROWID""",
        """CREATE TABLE fenced_checkpoints (
            checkpoint_id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            namespace TEXT NOT NULL,
            gen INTEGER NOT NULL,
            fenced_at REAL NOT NULL
        ) WITHOUT ROWID""",
        "CREATE INDEX fenced_by_generation ON fenced_checkpoints (namespace, gen)",
    ),
    (
        # Tenants a `forget` crypto-erased, and their checkpoints, kept for explain and so that
        # no write computed before the forget is recorded after it (a restart included).
        """CREATE TABLE forgotten_tenants (
            tenant TEXT PRIMARY KEY,
            forgotten_at REAL NOT NULL
        ) WITHOUT ROWID""",
        """CREATE TABLE forgotten_checkpoints (
            checkpoint_id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            forgotten_at REAL NOT NULL
        ) WITHOUT ROWID""",
    ),
)
"""Schema migrations in order, in SQLite's words (``migration_sql`` gives PostgreSQL's); the
catalog's ``schema_version`` is how many have been applied."""


def migration_sql(statement: str, dialect: Dialect) -> str:
    """One migration statement for ``dialect``: PostgreSQL's REAL is 4 bytes and its INTEGER 4,
    where SQLite's are 8, so they become DOUBLE PRECISION and BIGINT; WITHOUT ROWID is SQLite's."""
    if dialect == "sqlite":
        return statement
    return (
        statement.replace(" WITHOUT ROWID", "")
        .replace(" REAL", " DOUBLE PRECISION")
        .replace(" INTEGER", " BIGINT")
    )

_UNREFERENCED = (
    "NOT EXISTS (SELECT 1 FROM checkpoint_pages AS cp"
    " WHERE cp.namespace = p.namespace AND cp.key = p.key)"
)
# Takes one parameter, the time now.
_UNLEASED = (
    "NOT EXISTS (SELECT 1 FROM blob_leases AS l"
    " WHERE l.namespace = p.namespace AND l.key = p.key AND l.expiry > ?)"
)


class PageRef(BaseModel):
    """One page of a checkpoint: its key and the size of its blob on disk."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    key: str = Field(pattern=_HEX_KEY)
    nbytes: int = Field(gt=0)


class KVCheckpointRecord(BaseModel):
    """A durable KV checkpoint and why it exists (the seed's :KVCheckpoint node).

    Times are Unix seconds. ``recommendation_json`` and ``decision_json`` (the eligibility
    decision with its derivation) are JSON texts kept verbatim for explain surfaces.
    ``slot_bytes`` is the payload size of each page; ``PageRef.nbytes`` the blob's file size,
    which is what the disk bound counts.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    checkpoint_id: str = Field(min_length=1, max_length=256)
    tenant: str = Field(min_length=1)
    namespace: str = Field(pattern=_HEX_NAMESPACE)
    trigger: Literal["user", "agent", "system"]
    recommendation_json: str
    decision_json: str
    created: float
    retention_expiry: float | None
    last_used: float
    slot_bytes: int = Field(gt=0)
    pages: tuple[PageRef, ...] = Field(min_length=1)

    @field_validator("recommendation_json", "decision_json")
    @classmethod
    def _is_json(cls, value: str) -> str:
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be JSON text: {exc}") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KVCheckpointRecord:
        keys = [page.key for page in self.pages]
        if len(set(keys)) != len(keys):
            raise ValueError("pages: a page key appears twice")
        if self.retention_expiry is not None and self.retention_expiry <= self.created:
            raise ValueError("retention_expiry must be later than created")
        if self.last_used < self.created:
            raise ValueError("last_used must not be earlier than created")
        return self

    @property
    def page_keys(self) -> tuple[PageKey, ...]:
        return tuple(bytes.fromhex(page.key) for page in self.pages)

    @property
    def nbytes(self) -> int:
        return sum(page.nbytes for page in self.pages)


@dataclass(frozen=True)
class PageId:
    """A page row: its namespace and key."""

    namespace: bytes
    key: PageKey


@dataclass(frozen=True)
class Removal:
    """What a catalog call removed; the caller deletes the blob files of ``pages``."""

    checkpoint_ids: tuple[str, ...] = ()
    pages: tuple[PageId, ...] = ()

    def __add__(self, other: Removal) -> Removal:
        return Removal(self.checkpoint_ids + other.checkpoint_ids, self.pages + other.pages)


@dataclass(frozen=True)
class CatalogStats:
    checkpoints: int
    pages: int
    unreferenced_pages: int
    bytes_used: int
    unreferenced_bytes: int


def _combine_expiry(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a, b)


def _page_id(row: Row) -> PageId:
    return PageId(bytes.fromhex(row["namespace"]), bytes.fromhex(row["key"]))


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _marks(n: int) -> str:
    return ",".join("?" * n)


class CheckpointCatalog:
    """The catalog of durable checkpoints. Thread-safe.

    ``path``: the embedded SQLite file (one process). ``url``: a PostgreSQL database shared by
    any number of processes and nodes; exactly one of the two. ``timeouts``: how long a call
    waits on the database.
    """

    def __init__(
        self,
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
        *,
        url: str | None = None,
        timeouts: DependencyTimeouts = DependencyTimeouts(),
    ) -> None:
        if (path is None) == (url is None):
            raise ValueError("a catalog needs exactly one of path (SQLite) and url (PostgreSQL)")
        self._clock = clock
        self._db: CatalogDatabase = open_catalog_database(url, path, timeouts)
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    @property
    def path(self) -> Path | None:
        return getattr(self._db, "path", None)

    @property
    def dialect(self) -> Dialect:
        return self._db.dialect

    def describe(self) -> str:
        return self._db.describe()

    def close(self) -> None:
        self._db.close()

    def locked(self) -> AbstractContextManager[Transaction]:
        """One write transaction around several calls (they join it), excluding every other
        writer of the catalog, in every process and on every node, until it ends."""
        return self._db.write()

    def _migrate(self) -> None:
        with self._db.write() as db:
            db.execute(migration_sql(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
                self._db.dialect,
            ))
            row = db.execute("SELECT version FROM schema_version").fetchone()
            version = 0 if row is None else row["version"]
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"{self.describe()}: catalog schema version {version} is newer than this "
                    f"kvci understands ({len(MIGRATIONS)})"
                )
            for statements in MIGRATIONS[version:]:
                for statement in statements:
                    db.execute(migration_sql(statement, self._db.dialect))
            if row is None:
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (len(MIGRATIONS),))
            else:
                db.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS),))

    def schema_version(self) -> int:
        with self._db.read() as db:
            return db.execute("SELECT version FROM schema_version").fetchone()["version"]

    # ---- leases and shards ------------------------------------------------------------------

    def lease(self, namespace: bytes, keys: Sequence[PageKey], holder: str, until: float) -> None:
        """Hold ``keys`` for ``holder`` until ``until``: their blobs are not deleted meanwhile."""
        ns = check_namespace(namespace).hex()
        check_checkpoint_id(holder)
        rows = [(ns, check_page_key(k).hex(), holder, until) for k in keys]
        with self._db.write() as db:
            db.executemany(
                "INSERT INTO blob_leases (namespace, key, holder, expiry) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (namespace, key, holder) DO UPDATE SET expiry = excluded.expiry",
                rows,
            )

    def release(self, holder: str) -> None:
        """Give up ``holder``'s leases (its write ended, recorded or not)."""
        with self._db.write() as db:
            db.execute("DELETE FROM blob_leases WHERE holder = ?", (check_checkpoint_id(holder),))

    def release_all(self) -> None:
        """End every lease: only for the sole user of an embedded catalog, at start-up."""
        with self._db.write() as db:
            db.execute("DELETE FROM blob_leases")

    def leased(self, namespace: bytes, keys: Sequence[PageKey], holder: str | None = None) -> set[PageKey]:
        """Which of ``keys`` are under a live lease (of a holder other than ``holder``)."""
        ns = check_namespace(namespace).hex()
        hexes = [check_page_key(k).hex() for k in keys]
        now = self._clock()
        with self._db.read() as db:
            return {
                bytes.fromhex(row["key"])
                for chunk in _chunks(hexes)
                for row in db.execute(
                    "SELECT DISTINCT key FROM blob_leases WHERE namespace = ? AND expiry > ?"
                    f" AND holder <> ? AND key IN ({_marks(len(chunk))})",
                    (ns, now, holder or "", *chunk),
                )
            }

    def live_leases(self) -> set[tuple[str, str]]:
        """(namespace hex, key hex) of every page under a live lease."""
        with self._db.read() as db:
            return {
                (row["namespace"], row["key"])
                for row in db.execute(
                    "SELECT DISTINCT namespace, key FROM blob_leases WHERE expiry > ?",
                    (self._clock(),),
                )
            }

    def register_shards(self, namespace: bytes, shards: Sequence[bytes]) -> None:
        """Record the namespaces the ranks of ``namespace``'s engine write their blobs under."""
        ns = check_namespace(namespace).hex()
        rows = [(ns, check_namespace(shard).hex()) for shard in shards]
        with self._db.write() as db:
            db.executemany(
                "INSERT INTO namespace_shards (namespace, shard) VALUES (?, ?)"
                " ON CONFLICT (namespace, shard) DO NOTHING",
                rows,
            )

    def shards(self) -> dict[bytes, tuple[bytes, ...]]:
        """Every namespace with registered shards, and those shards."""
        found: dict[bytes, list[bytes]] = {}
        with self._db.read() as db:
            for row in db.execute(
                "SELECT namespace, shard FROM namespace_shards ORDER BY namespace, shard"
            ):
                found.setdefault(bytes.fromhex(row["namespace"]), []).append(
                    bytes.fromhex(row["shard"])
                )
        return {ns: tuple(shards) for ns, shards in found.items()}

    # ---- generations ------------------------------------------------------------------------

    def generation(self, base: bytes) -> int:
        """The generation engines of namespace ``base`` key their KV in (0 before any reset)."""
        with self._db.read() as db:
            row = db.execute(
                "SELECT gen FROM generations WHERE namespace = ?", (check_namespace(base).hex(),)
            ).fetchone()
        return 0 if row is None else int(row["gen"])

    def advance_generation(self, base: bytes, current: int, namespace: bytes) -> tuple[int, Removal]:
        """A cache reset by an engine of ``base`` keyed in generation ``current`` (as
        ``namespace``): forget every checkpoint and page of ``namespace``, for every node at once,
        and return the generation to key in from now on, with what was removed.

        The next generation, unless another node's reset already started a later one: then this
        engine joins it, so nodes that reset together share KV again.
        """
        base_hex, ns = check_namespace(base).hex(), check_namespace(namespace).hex()
        now = self._clock()
        with self._db.write() as db:
            row = db.execute("SELECT gen FROM generations WHERE namespace = ?", (base_hex,)).fetchone()
            latest = 0 if row is None else int(row["gen"])
            new = latest if latest > current else current + 1
            db.execute(
                "INSERT INTO generations (namespace, gen, reset_at) VALUES (?, ?, ?)"
                " ON CONFLICT (namespace) DO UPDATE SET gen = excluded.gen,"
                " reset_at = excluded.reset_at",
                (base_hex, new, now),
            )
            fenced = db.execute(
                "SELECT checkpoint_id, tenant FROM checkpoints WHERE namespace = ?"
                " ORDER BY checkpoint_id",
                (ns,),
            ).fetchall()
            db.executemany(
                "INSERT INTO fenced_checkpoints (checkpoint_id, tenant, namespace, gen, fenced_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (checkpoint_id) DO NOTHING",
                [(r["checkpoint_id"], r["tenant"], base_hex, new, now) for r in fenced],
            )
            # Tombstones only answer explain: the last few generations' are kept.
            db.execute(
                "DELETE FROM fenced_checkpoints WHERE namespace = ? AND gen <= ?",
                (base_hex, new - FENCED_GENERATIONS_KEPT),
            )
            db.execute("DELETE FROM checkpoints WHERE namespace = ?", (ns,))
            pages = [
                _page_id(r)
                for r in db.execute("SELECT namespace, key FROM pages WHERE namespace = ?", (ns,))
            ]
            db.execute("DELETE FROM pages WHERE namespace = ?", (ns,))
            return new, Removal(
                tuple(r["checkpoint_id"] for r in fenced), self._unleased(db, pages))

    def fenced(self, checkpoint_id: str) -> tuple[str, float, int] | None:
        """(tenant, fenced_at, generation begun) of a checkpoint a cache reset fenced, or None."""
        check_checkpoint_id(checkpoint_id)
        with self._db.read() as db:
            row = db.execute(
                "SELECT tenant, fenced_at, gen FROM fenced_checkpoints WHERE checkpoint_id = ?",
                (checkpoint_id,),
            ).fetchone()
        return None if row is None else (row["tenant"], float(row["fenced_at"]), int(row["gen"]))

    # ---- forgetting -------------------------------------------------------------------------

    def forget_tenant(self, tenant: str) -> Removal:
        """Forget every checkpoint and page of ``tenant``, in every namespace, for every node at
        once; remember when, so that explain can say so and no write computed before now is
        recorded later. Returns every page (leased ones too: a forgotten tenant's bytes go)."""
        check_tenant(tenant)
        now = self._clock()
        with self._db.write() as db:
            ids = tuple(
                row["checkpoint_id"]
                for row in db.execute(
                    "SELECT checkpoint_id FROM checkpoints WHERE tenant = ? ORDER BY checkpoint_id",
                    (tenant,),
                ).fetchall()
            )
            db.execute(
                "INSERT INTO forgotten_tenants (tenant, forgotten_at) VALUES (?, ?)"
                " ON CONFLICT (tenant) DO UPDATE SET forgotten_at = excluded.forgotten_at",
                (tenant, now),
            )
            db.executemany(
                "INSERT INTO forgotten_checkpoints (checkpoint_id, tenant, forgotten_at)"
                " VALUES (?, ?, ?) ON CONFLICT (checkpoint_id) DO NOTHING",
                [(cid, tenant, now) for cid in ids],
            )
            db.execute("DELETE FROM checkpoints WHERE tenant = ?", (tenant,))
            pages = tuple(
                _page_id(row)
                for row in db.execute(
                    "SELECT namespace, key FROM pages WHERE tenant = ?", (tenant,)
                ).fetchall()
            )
            db.execute("DELETE FROM pages WHERE tenant = ?", (tenant,))
        return Removal(ids, pages)

    def forgotten(self, checkpoint_id: str) -> tuple[str, float] | None:
        """(tenant, forgotten_at) of a checkpoint a forget erased, or None."""
        check_checkpoint_id(checkpoint_id)
        with self._db.read() as db:
            row = db.execute(
                "SELECT tenant, forgotten_at FROM forgotten_checkpoints WHERE checkpoint_id = ?",
                (checkpoint_id,),
            ).fetchone()
        return None if row is None else (row["tenant"], float(row["forgotten_at"]))

    def forgotten_at(self, tenant: str) -> float | None:
        """When ``tenant`` was last forgotten, or None."""
        with self._db.read() as db:
            row = db.execute(
                "SELECT forgotten_at FROM forgotten_tenants WHERE tenant = ?", (check_tenant(tenant),)
            ).fetchone()
        return None if row is None else float(row["forgotten_at"])

    # ---- writes -----------------------------------------------------------------------------

    def add_checkpoint(self, record: KVCheckpointRecord, holder: str | None = None,
                       began: float | None = None) -> None:
        """Record a checkpoint whose blobs are already durable, in one transaction; ``holder``'s
        leases end with it.

        A page already held (shared with another checkpoint) is stored once; a page held under
        another tenant refuses the whole record, and so does a forget of its tenant since the
        write began (``began``, else ``record.created``).
        """
        if not isinstance(record, KVCheckpointRecord):
            raise TypeError(f"record must be a KVCheckpointRecord, not {type(record).__name__}")
        if record.retention_expiry is not None and record.retention_expiry <= self._clock():
            raise ValueError(f"checkpoint {record.checkpoint_id}: retention_expiry has passed")
        ns = record.namespace
        with self._db.write() as db:
            if db.execute(
                "SELECT 1 AS found FROM checkpoints WHERE checkpoint_id = ?",
                (record.checkpoint_id,),
            ).fetchone():
                raise CheckpointExistsError(f"checkpoint {record.checkpoint_id} already exists")
            forgotten = db.execute(
                "SELECT forgotten_at FROM forgotten_tenants WHERE tenant = ?", (record.tenant,)
            ).fetchone()
            began = record.created if began is None else min(began, record.created)
            if forgotten is not None and began <= forgotten["forgotten_at"]:
                raise TenantForgottenError(
                    f"checkpoint {record.checkpoint_id}: its tenant was forgotten after it was "
                    "computed; not recorded")
            for position, page in enumerate(record.pages):
                held = db.execute(
                    "SELECT tenant, last_used, retention_expiry FROM pages"
                    " WHERE namespace = ? AND key = ?",
                    (ns, page.key),
                ).fetchone()
                if held is None:
                    db.execute(
                        "INSERT INTO pages (namespace, key, tenant, bytes, last_used,"
                        " retention_expiry) VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            ns,
                            page.key,
                            record.tenant,
                            page.nbytes,
                            record.last_used,
                            record.retention_expiry,
                        ),
                    )
                elif held["tenant"] != record.tenant:
                    raise TenantMismatchError(
                        f"checkpoint {record.checkpoint_id}: page {position} is held by another "
                        "tenant"
                    )
                else:
                    db.execute(
                        "UPDATE pages SET bytes = ?, last_used = ?, retention_expiry = ?"
                        " WHERE namespace = ? AND key = ?",
                        (
                            page.nbytes,
                            max(held["last_used"], record.last_used),
                            _combine_expiry(held["retention_expiry"], record.retention_expiry),
                            ns,
                            page.key,
                        ),
                    )
            db.execute(
                "INSERT INTO checkpoints (checkpoint_id, tenant, namespace, trigger,"
                " recommendation_json, decision_json, created, retention_expiry, slot_bytes,"
                " bytes, last_used, page_count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.checkpoint_id,
                    record.tenant,
                    ns,
                    record.trigger,
                    record.recommendation_json,
                    record.decision_json,
                    record.created,
                    record.retention_expiry,
                    record.slot_bytes,
                    record.nbytes,
                    record.last_used,
                    len(record.pages),
                ),
            )
            db.executemany(
                "INSERT INTO checkpoint_pages (checkpoint_id, position, namespace, key)"
                " VALUES (?, ?, ?, ?)",
                [(record.checkpoint_id, i, ns, page.key) for i, page in enumerate(record.pages)],
            )
            if holder is not None:
                db.execute("DELETE FROM blob_leases WHERE holder = ?", (holder,))

    def touch(self, namespace: bytes, keys: Sequence[PageKey]) -> None:
        """Mark pages used now, and with them every checkpoint that holds one (as the RAM tier)."""
        ns = check_namespace(namespace).hex()
        hexes = [check_page_key(k).hex() for k in keys]
        now = self._clock()
        with self._db.write() as db:
            for chunk in _chunks(hexes):
                params = (now, ns, *chunk)
                db.execute(
                    "UPDATE pages SET last_used = ? WHERE namespace = ?"
                    f" AND key IN ({_marks(len(chunk))})",
                    params,
                )
                db.execute(
                    "UPDATE checkpoints SET last_used = ? WHERE checkpoint_id IN"
                    " (SELECT checkpoint_id FROM checkpoint_pages WHERE namespace = ?"
                    f" AND key IN ({_marks(len(chunk))}))",
                    params,
                )

    def remove(self, checkpoint_id: str) -> Removal:
        """Forget a checkpoint and the pages no other checkpoint holds."""
        check_checkpoint_id(checkpoint_id)
        with self._db.write() as db:
            pages = [
                _page_id(row)
                for row in db.execute(
                    "SELECT namespace, key FROM checkpoint_pages WHERE checkpoint_id = ?",
                    (checkpoint_id,),
                ).fetchall()
            ]
            if not db.execute(
                "DELETE FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,)
            ).rowcount:
                raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id}")
            gone = [p for p in pages if self._delete_page_if_unreferenced(db, p)]
            return Removal((checkpoint_id,), self._unleased(db, gone))

    def drop_pages(self, pages: Iterable[PageId]) -> Removal:
        """Forget pages whose blobs are gone or bad, with every checkpoint that needs them.

        The other pages of those checkpoints stay as unreferenced pages. A page under another
        writer's lease loses its row but keeps its blob: that writer records it anew.
        """
        wanted = list(pages)
        with self._db.write() as db:
            checkpoint_ids: list[str] = []
            gone: list[PageId] = []
            for page in wanted:
                ns, key = page.namespace.hex(), page.key.hex()
                for row in db.execute(
                    "SELECT DISTINCT checkpoint_id FROM checkpoint_pages"
                    " WHERE namespace = ? AND key = ?",
                    (ns, key),
                ).fetchall():
                    db.execute(
                        "DELETE FROM checkpoints WHERE checkpoint_id = ?", (row["checkpoint_id"],)
                    )
                    checkpoint_ids.append(row["checkpoint_id"])
                if db.execute(
                    "DELETE FROM pages WHERE namespace = ? AND key = ?", (ns, key)
                ).rowcount:
                    gone.append(page)
            return Removal(tuple(checkpoint_ids), self._unleased(db, gone))

    def gc_expired(self, now: float) -> Removal:
        """Remove checkpoints whose retention has expired, then expired unreferenced pages that
        no live lease holds."""
        with self._db.write() as db:
            ids = tuple(
                row["checkpoint_id"]
                for row in db.execute(
                    "SELECT checkpoint_id FROM checkpoints"
                    " WHERE retention_expiry IS NOT NULL AND retention_expiry <= ?"
                    " ORDER BY checkpoint_id",
                    (now,),
                ).fetchall()
            )
            db.executemany("DELETE FROM checkpoints WHERE checkpoint_id = ?", [(i,) for i in ids])
            pages = tuple(
                _page_id(row)
                for row in db.execute(
                    "SELECT namespace, key FROM pages AS p WHERE retention_expiry IS NOT NULL"
                    f" AND retention_expiry <= ? AND {_UNREFERENCED} AND {_UNLEASED}",
                    (now, self._clock()),
                ).fetchall()
            )
            db.executemany(
                "DELETE FROM pages WHERE namespace = ? AND key = ?",
                [(p.namespace.hex(), p.key.hex()) for p in pages],
            )
        return Removal(ids, pages)

    def evict_to(self, disk_bytes: int, protect: str | None = None) -> Removal:
        """Drop pages (and, if need be, whole checkpoints) until the pages take <= ``disk_bytes``.

        See the module docstring for the order. ``protect`` names a checkpoint that is never
        chosen (the one just written); the bound may then stay exceeded if it alone exceeds it.
        Pages under a live lease are never chosen either.
        """
        if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes < 0:
            raise ValueError(f"disk_bytes must be an int >= 0, not {disk_bytes!r}")
        checkpoint_ids: list[str] = []
        pages: list[PageId] = []
        now = self._clock()
        with self._db.write() as db:
            total = db.execute(
                "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT) AS total FROM pages"
            ).fetchone()["total"]
            while total > disk_bytes:
                batch = db.execute(
                    f"SELECT namespace, key, bytes FROM pages AS p WHERE {_UNREFERENCED}"
                    f" AND {_UNLEASED} ORDER BY last_used, namespace, key LIMIT ?",
                    (now, _CHUNK),
                ).fetchall()
                for row in batch:
                    if total <= disk_bytes:
                        break
                    db.execute(
                        "DELETE FROM pages WHERE namespace = ? AND key = ?",
                        (row["namespace"], row["key"]),
                    )
                    pages.append(_page_id(row))
                    total -= row["bytes"]
                if batch:
                    continue
                if protect is None:
                    victim = db.execute(
                        "SELECT checkpoint_id FROM checkpoints"
                        " ORDER BY last_used, created, checkpoint_id LIMIT 1"
                    ).fetchone()
                else:
                    victim = db.execute(
                        "SELECT checkpoint_id FROM checkpoints WHERE checkpoint_id <> ?"
                        " ORDER BY last_used, created, checkpoint_id LIMIT 1",
                        (protect,),
                    ).fetchone()
                if victim is None:
                    break
                db.execute(
                    "DELETE FROM checkpoints WHERE checkpoint_id = ?", (victim["checkpoint_id"],)
                )
                checkpoint_ids.append(victim["checkpoint_id"])
        return Removal(tuple(checkpoint_ids), tuple(pages))

    # ---- reads ------------------------------------------------------------------------------

    def find(self, checkpoint_id: str) -> KVCheckpointRecord | None:
        """The raw record, expired or not, for explain surfaces that check tenancy themselves."""
        check_checkpoint_id(checkpoint_id)
        with self._db.read() as db:
            return self._record(db, checkpoint_id)

    def get(self, checkpoint_id: str, tenant: str) -> KVCheckpointRecord:
        """The live record of ``tenant``'s checkpoint; another tenant's valid id is refused."""
        check_tenant(tenant)
        record = self.find(checkpoint_id)
        if record is None or (
            record.retention_expiry is not None and record.retention_expiry <= self._clock()
        ):
            raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id}")
        if record.tenant != tenant:
            raise TenantMismatchError(f"checkpoint {checkpoint_id} belongs to another tenant")
        return record

    def list(self, tenant: str | None = None) -> list[KVCheckpointRecord]:
        """Checkpoints (expired ones included until collected), oldest first."""
        if tenant is not None:
            check_tenant(tenant)
        with self._db.read() as db:
            if tenant is None:
                rows = db.execute(
                    "SELECT checkpoint_id FROM checkpoints ORDER BY created, checkpoint_id"
                ).fetchall()
            else:
                rows = db.execute(
                    "SELECT checkpoint_id FROM checkpoints WHERE tenant = ?"
                    " ORDER BY created, checkpoint_id",
                    (tenant,),
                ).fetchall()
            records = (self._record(db, row["checkpoint_id"]) for row in rows)
            return [r for r in records if r is not None]

    def longest_prefix(self, namespace: bytes, keys: Sequence[PageKey], tenant: str) -> int:
        """How many leading ``keys`` are live pages of ``tenant``. Changes nothing."""
        ns = check_namespace(namespace).hex()
        check_tenant(tenant)
        hexes = [check_page_key(k).hex() for k in keys]
        now = self._clock()
        n = 0
        with self._db.read() as db:
            for chunk in _chunks(hexes):
                present = {
                    row["key"]
                    for row in db.execute(
                        "SELECT key FROM pages WHERE namespace = ? AND tenant = ?"
                        " AND (retention_expiry IS NULL OR retention_expiry > ?)"
                        f" AND key IN ({_marks(len(chunk))})",
                        (ns, tenant, now, *chunk),
                    )
                }
                for key in chunk:
                    if key not in present:
                        return n
                    n += 1
        return n

    def held_pages(self, namespace: bytes, keys: Sequence[PageKey]) -> set[PageKey]:
        """Which of ``keys`` have a page row in ``namespace``, whatever their tenant or expiry."""
        ns = check_namespace(namespace).hex()
        hexes = [check_page_key(k).hex() for k in keys]
        with self._db.read() as db:
            return {
                bytes.fromhex(row["key"])
                for chunk in _chunks(hexes)
                for row in db.execute(
                    f"SELECT key FROM pages WHERE namespace = ? AND key IN ({_marks(len(chunk))})",
                    (ns, *chunk),
                )
            }

    def pages(self) -> list[tuple[PageId, str]]:
        """Every page row with its tenant, any namespace (for reconciliation and audits)."""
        with self._db.read() as db:
            return [
                (_page_id(row), row["tenant"])
                for row in db.execute("SELECT namespace, key, tenant FROM pages")
            ]

    def unreferenced_pages(self) -> list[PageId]:
        """Pages no checkpoint holds, least recently used first."""
        with self._db.read() as db:
            return [
                _page_id(row)
                for row in db.execute(
                    f"SELECT namespace, key FROM pages AS p WHERE {_UNREFERENCED}"
                    " ORDER BY last_used, namespace, key"
                )
            ]

    def stats(self) -> CatalogStats:
        with self._db.read() as db:
            checkpoints = db.execute("SELECT count(*) AS n FROM checkpoints").fetchone()["n"]
            row = db.execute(
                "SELECT count(*) AS n, CAST(coalesce(sum(bytes), 0) AS BIGINT) AS used FROM pages"
            ).fetchone()
            loose = db.execute(
                "SELECT count(*) AS n, CAST(coalesce(sum(bytes), 0) AS BIGINT) AS used"
                f" FROM pages AS p WHERE {_UNREFERENCED}"
            ).fetchone()
        return CatalogStats(checkpoints, row["n"], loose["n"], row["used"], loose["used"])

    # ---- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _record(db: Transaction, checkpoint_id: str) -> KVCheckpointRecord | None:
        row = db.execute(
            "SELECT * FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,)
        ).fetchone()
        if row is None:
            return None
        pages = tuple(
            PageRef(key=page["key"], nbytes=page["bytes"])
            for page in db.execute(
                "SELECT cp.key, p.bytes FROM checkpoint_pages AS cp JOIN pages AS p"
                " ON p.namespace = cp.namespace AND p.key = cp.key"
                " WHERE cp.checkpoint_id = ? ORDER BY cp.position",
                (checkpoint_id,),
            ).fetchall()
        )
        return KVCheckpointRecord(
            checkpoint_id=row["checkpoint_id"],
            tenant=row["tenant"],
            namespace=row["namespace"],
            trigger=row["trigger"],
            recommendation_json=row["recommendation_json"],
            decision_json=row["decision_json"],
            created=row["created"],
            retention_expiry=row["retention_expiry"],
            last_used=row["last_used"],
            slot_bytes=row["slot_bytes"],
            pages=pages,
        )

    @staticmethod
    def _delete_page_if_unreferenced(db: Transaction, page: PageId) -> bool:
        return bool(
            db.execute(
                f"DELETE FROM pages AS p WHERE namespace = ? AND key = ? AND {_UNREFERENCED}",
                (page.namespace.hex(), page.key.hex()),
            ).rowcount
        )

    def _unleased(self, db: Transaction, pages: Sequence[PageId]) -> tuple[PageId, ...]:
        """``pages`` less those under a live lease: their blobs are another writer's now."""
        now = self._clock()
        return tuple(
            page
            for page in pages
            if db.execute(
                "SELECT 1 AS found FROM blob_leases WHERE namespace = ? AND key = ? AND expiry > ?",
                (page.namespace.hex(), page.key.hex(), now),
            ).fetchone()
            is None
        )
