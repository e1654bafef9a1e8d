"""CheckpointCatalog: the durable record of the disk tier, scheduler side.

Embedded SQLite (WAL) by default; PostgreSQL (``catalog_url``) when several nodes share the
tier. The same schema, migrations (``disk.schema``) and SQL run on both (``disk.db``).

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

Eviction (``evict_to``): least recently used unreferenced pages first, then whole
checkpoints, over-share tenants' first (``disk.eviction``).

Fences. A cache reset's generations and a forget's tombstones: ``disk.fences``.

Leases. A writer leases the pages it is about to write (``lease``, which registers the write under
its tenant) before touching a blob and gives the lease up when its checkpoint is recorded
(``add_checkpoint(holder=...)``) or has failed (``release``). A forget of the tenant ends the
registration: the write is then never recorded. No call that removes page rows hands back a page
under a live lease for deletion, and eviction never chooses one, so a node's eviction or retention
GC cannot delete a blob another node has just written or decided to reuse. A writer that dies leaves
its lease to expire. Removals run in write transactions; the caller deletes the blobs once the
removal has committed, outside the lock (a slow blob store must hold up no node's catalog writes),
skipping pages leased or recorded again since. A write that leases a page in the short window before
its blob's deletion loses the blob: a miss, never wrong KV (every blob is verified when loaded).

Shards. Under tensor parallelism each rank writes its part of a page into its own namespace;
the catalog records one page per key under the first rank's namespace and maps that namespace
to every rank's (``register_shards``), so whoever removes a page removes every shard's blob.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from kvci_plugin.tiering.blobs.codec import check_namespace
from kvci_plugin.tiering.disk.db import (
    CatalogDatabase,
    Dialect,
    Transaction,
    open_catalog_database,
)
from kvci_plugin.tiering.disk.eviction import evict
from kvci_plugin.tiering.disk.fences import CatalogFences, tenant_erased_at
from kvci_plugin.tiering.disk.records import CatalogStats, KVCheckpointRecord, PageId, Removal
from kvci_plugin.tiering.disk.schema import migrate
from kvci_plugin.tiering.disk.sql import (
    UNLEASED,
    UNREFERENCED,
    chunks,
    delete_page_if_unreferenced,
    marks,
    page_id,
    read_record,
    unleased,
)
from kvci_plugin.tiering.timeouts import DependencyTimeouts
from kvci_plugin.tiering.types import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    PageKey,
    TenantForgottenError,
    TenantMismatchError,
    check_checkpoint_id,
    check_page_key,
    check_tenant,
)


def _combine_expiry(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a, b)


class CheckpointCatalog(CatalogFences):
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
            migrate(self._db)
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

    def schema_version(self) -> int:
        with self._db.read() as db:
            return db.execute("SELECT version FROM schema_version").fetchone()["version"]

    # ---- leases and shards ------------------------------------------------------------------

    def lease(
        self, namespace: bytes, keys: Sequence[PageKey], holder: str, until: float, tenant: str,
        computed_epoch: int | None = None,
    ) -> None:
        """Hold ``keys`` for ``holder``, a write of ``tenant``, until ``until``: their blobs are
        not deleted meanwhile, and the write may be recorded unless its tenant is forgotten.
        A write whose KV was computed at an erasure epoch older than the tenant's last forget
        (``computed_epoch``) is refused: ``TenantForgottenError``, nothing leased."""
        ns = check_namespace(namespace).hex()
        check_checkpoint_id(holder)
        check_tenant(tenant)
        rows = [(ns, check_page_key(k).hex(), holder, until) for k in keys]
        with self._db.write() as db:
            if computed_epoch is not None and tenant_erased_at(db, tenant) > computed_epoch:
                raise TenantForgottenError(
                    f"write {holder}: its KV was computed before its tenant was forgotten"
                )
            # Dead writers' leases (and registrations) end here: both tables stay as small as
            # the writes under way.
            db.execute("DELETE FROM blob_leases WHERE expiry <= ?", (self._clock(),))
            db.execute(
                "DELETE FROM tenant_writes WHERE NOT EXISTS (SELECT 1 FROM blob_leases"
                " AS l WHERE l.holder = tenant_writes.holder)"
            )
            db.execute(
                "INSERT INTO tenant_writes (holder, tenant) VALUES (?, ?)"
                " ON CONFLICT (holder) DO NOTHING",
                (holder, tenant),
            )
            db.executemany(
                "INSERT INTO blob_leases (namespace, key, holder, expiry) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (namespace, key, holder) DO UPDATE SET expiry = excluded.expiry",
                rows,
            )

    def release(self, holder: str) -> None:
        """Give up ``holder``'s leases (its write ended, recorded or not)."""
        with self._db.write() as db:
            db.execute("DELETE FROM blob_leases WHERE holder = ?", (check_checkpoint_id(holder),))
            db.execute("DELETE FROM tenant_writes WHERE holder = ?", (holder,))

    def release_all(self) -> None:
        """End every lease: only for the sole user of an embedded catalog, at start-up."""
        with self._db.write() as db:
            db.execute("DELETE FROM blob_leases")
            db.execute("DELETE FROM tenant_writes")

    def leased(
        self, namespace: bytes, keys: Sequence[PageKey], holder: str | None = None
    ) -> set[PageKey]:
        """Which of ``keys`` are under a live lease (of a holder other than ``holder``)."""
        ns = check_namespace(namespace).hex()
        hexes = [check_page_key(k).hex() for k in keys]
        now = self._clock()
        with self._db.read() as db:
            return {
                bytes.fromhex(row["key"])
                for chunk in chunks(hexes)
                for row in db.execute(
                    "SELECT DISTINCT key FROM blob_leases WHERE namespace = ? AND expiry > ?"
                    f" AND holder <> ? AND key IN ({marks(len(chunk))})",
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

    def known_blobs(self) -> set[tuple[str, str]]:
        """(namespace hex[:32], key hex) of every blob a page row or a live lease accounts for,
        in every shard namespace (reconciliation: what is not here is an orphan)."""
        shards = self.shards()
        named = [(page.namespace, page.key.hex()) for page, _ in self.pages()]
        named += [(bytes.fromhex(ns), key) for ns, key in self.live_leases()]
        return {(shard.hex()[:32], key) for ns, key in named for shard in (ns, *shards.get(ns, ()))}

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

    # ---- writes -----------------------------------------------------------------------------

    def add_checkpoint(
        self, record: KVCheckpointRecord, holder: str | None = None,
        computed_epoch: int | None = None,
    ) -> None:
        """Record a checkpoint whose blobs are already durable, in one transaction; ``holder``'s
        leases end with it.

        A page already held (shared with another checkpoint) is stored once; a page held under
        another tenant refuses the whole record, and so does a forget of its tenant since
        ``holder``'s write was leased (its registration is gone), or since its KV was computed:
        ``computed_epoch`` is the erasure epoch the computing node knew then (``erasure_epoch``),
        refused when the tenant's last forget began a later one.
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
            if computed_epoch is not None and tenant_erased_at(db, record.tenant) > computed_epoch:
                raise TenantForgottenError(
                    f"checkpoint {record.checkpoint_id}: its KV was computed before its tenant "
                    "was forgotten; not recorded"
                )
            if holder is not None:
                write = db.execute(
                    "SELECT tenant FROM tenant_writes WHERE holder = ?", (holder,)
                ).fetchone()
                if write is None or write["tenant"] != record.tenant:
                    raise TenantForgottenError(
                        f"checkpoint {record.checkpoint_id}: its tenant was forgotten while it "
                        "was written (or its lease ended); not recorded"
                    )
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
                db.execute("DELETE FROM tenant_writes WHERE holder = ?", (holder,))

    def touch(self, namespace: bytes, keys: Sequence[PageKey]) -> None:
        """Mark pages used now, and with them every checkpoint that holds one (as the RAM tier)."""
        ns = check_namespace(namespace).hex()
        hexes = [check_page_key(k).hex() for k in keys]
        now = self._clock()
        with self._db.write() as db:
            for chunk in chunks(hexes):
                params = (now, ns, *chunk)
                db.execute(
                    "UPDATE pages SET last_used = ? WHERE namespace = ?"
                    f" AND key IN ({marks(len(chunk))})",
                    params,
                )
                db.execute(
                    "UPDATE checkpoints SET last_used = ? WHERE checkpoint_id IN"
                    " (SELECT checkpoint_id FROM checkpoint_pages WHERE namespace = ?"
                    f" AND key IN ({marks(len(chunk))}))",
                    params,
                )

    def remove(self, checkpoint_id: str) -> Removal:
        """Forget a checkpoint and the pages no other checkpoint holds."""
        check_checkpoint_id(checkpoint_id)
        with self._db.write() as db:
            pages = [
                page_id(row)
                for row in db.execute(
                    "SELECT namespace, key FROM checkpoint_pages WHERE checkpoint_id = ?",
                    (checkpoint_id,),
                ).fetchall()
            ]
            if not db.execute(
                "DELETE FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,)
            ).rowcount:
                raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id}")
            gone = [p for p in pages if delete_page_if_unreferenced(db, p)]
            return Removal((checkpoint_id,), unleased(db, gone, self._clock()))

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
            return Removal(tuple(checkpoint_ids), unleased(db, gone, self._clock()))

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
                page_id(row)
                for row in db.execute(
                    "SELECT namespace, key FROM pages AS p WHERE retention_expiry IS NOT NULL"
                    f" AND retention_expiry <= ? AND {UNREFERENCED} AND {UNLEASED}",
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

        See the module docstring for the order; among checkpoints, those of tenants holding more
        than their fair share (``disk_bytes`` split among the tenants holding pages) go first,
        so one tenant's writes evict its own durable checkpoints before anyone else's.
        ``protect`` names a checkpoint that is never chosen (the one just written); the bound
        may then stay exceeded if it alone exceeds it. Pages under a live lease are never
        chosen either.
        """
        if isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes < 0:
            raise ValueError(f"disk_bytes must be an int >= 0, not {disk_bytes!r}")
        now = self._clock()
        with self._db.write() as db:
            return evict(db, disk_bytes, protect, now)

    # ---- reads ------------------------------------------------------------------------------

    def find(self, checkpoint_id: str) -> KVCheckpointRecord | None:
        """The raw record, expired or not, for explain surfaces that check tenancy themselves."""
        check_checkpoint_id(checkpoint_id)
        with self._db.read() as db:
            return read_record(db, checkpoint_id)

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
            records = (read_record(db, row["checkpoint_id"]) for row in rows)
            return [r for r in records if r is not None]

    def longest_prefix(self, namespace: bytes, keys: Sequence[PageKey], tenant: str) -> int:
        """How many leading ``keys`` are live pages of ``tenant``. Changes nothing."""
        ns = check_namespace(namespace).hex()
        check_tenant(tenant)
        hexes = [check_page_key(k).hex() for k in keys]
        now = self._clock()
        n = 0
        with self._db.read() as db:
            for chunk in chunks(hexes):
                present = {
                    row["key"]
                    for row in db.execute(
                        "SELECT key FROM pages WHERE namespace = ? AND tenant = ?"
                        " AND (retention_expiry IS NULL OR retention_expiry > ?)"
                        f" AND key IN ({marks(len(chunk))})",
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
                for chunk in chunks(hexes)
                for row in db.execute(
                    f"SELECT key FROM pages WHERE namespace = ? AND key IN ({marks(len(chunk))})",
                    (ns, *chunk),
                )
            }

    def pages(self) -> list[tuple[PageId, str]]:
        """Every page row with its tenant, any namespace (for reconciliation and audits)."""
        with self._db.read() as db:
            return [
                (page_id(row), row["tenant"])
                for row in db.execute("SELECT namespace, key, tenant FROM pages")
            ]

    def unreferenced_pages(self) -> list[PageId]:
        """Pages no checkpoint holds, least recently used first."""
        with self._db.read() as db:
            return [
                page_id(row)
                for row in db.execute(
                    f"SELECT namespace, key FROM pages AS p WHERE {UNREFERENCED}"
                    " ORDER BY last_used, namespace, key"
                )
            ]

    def tenant_bytes(self) -> dict[str, int]:
        """Bytes of pages each tenant holds (what its fair share is measured against)."""
        with self._db.read() as db:
            return {
                row["tenant"]: int(row["held"])
                for row in db.execute(
                    "SELECT tenant, CAST(sum(bytes) AS BIGINT) AS held FROM pages GROUP BY tenant"
                ).fetchall()
            }

    def stats(self) -> CatalogStats:
        with self._db.read() as db:
            checkpoints = db.execute("SELECT count(*) AS n FROM checkpoints").fetchone()["n"]
            row = db.execute(
                "SELECT count(*) AS n, CAST(coalesce(sum(bytes), 0) AS BIGINT) AS used FROM pages"
            ).fetchone()
            loose = db.execute(
                "SELECT count(*) AS n, CAST(coalesce(sum(bytes), 0) AS BIGINT) AS used"
                f" FROM pages AS p WHERE {UNREFERENCED}"
            ).fetchone()
        return CatalogStats(checkpoints, row["n"], loose["n"], row["used"], loose["used"])
