"""What a cache reset and a forget leave in the catalog, for every node that shares it.

The generation each engine namespace keys its KV in (a reset starts the next one), the
checkpoints a reset fenced, the tenants a forget crypto-erased and their checkpoints: kept so
that explain can say why a checkpoint is gone, and so that nothing computed before either is
ever recorded after it, a restart included.
"""

from __future__ import annotations

from collections.abc import Callable

from kvci_plugin.tiering.blobs.codec import check_namespace
from kvci_plugin.tiering.disk.db import CatalogDatabase, Transaction
from kvci_plugin.tiering.disk.records import Removal
from kvci_plugin.tiering.disk.sql import page_id, unleased
from kvci_plugin.tiering.types import check_checkpoint_id, check_tenant

FENCED_GENERATIONS_KEPT = 16
"""Generations whose fenced checkpoints explain still names (older tombstones are deleted)."""


class CatalogFences:
    """The catalog's generations and tombstones: a part of ``CheckpointCatalog``, which owns the
    database and the clock."""

    _db: CatalogDatabase
    _clock: Callable[[], float]

    # ---- generations ------------------------------------------------------------------------

    def generation(self, base: bytes) -> int:
        """The generation engines of namespace ``base`` key their KV in (0 before any reset)."""
        with self._db.read() as db:
            row = db.execute(
                "SELECT gen FROM generations WHERE namespace = ?", (check_namespace(base).hex(),)
            ).fetchone()
        return 0 if row is None else int(row["gen"])

    def advance_generation(
        self, base: bytes, current: int, namespace: bytes
    ) -> tuple[int, Removal]:
        """A cache reset by an engine of ``base`` keyed in generation ``current`` (as
        ``namespace``): forget every checkpoint and page of ``namespace``, for every node at once,
        and return the generation to key in from now on, with what was removed.

        The next generation, unless another node's reset already started a later one: then this
        engine joins it, so nodes that reset together share KV again.
        """
        base_hex, ns = check_namespace(base).hex(), check_namespace(namespace).hex()
        now = self._clock()
        with self._db.write() as db:
            row = db.execute(
                "SELECT gen FROM generations WHERE namespace = ?", (base_hex,)
            ).fetchone()
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
                page_id(r)
                for r in db.execute("SELECT namespace, key FROM pages WHERE namespace = ?", (ns,))
            ]
            db.execute("DELETE FROM pages WHERE namespace = ?", (ns,))
            return new, Removal(
                tuple(r["checkpoint_id"] for r in fenced), unleased(db, pages, self._clock())
            )

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

    def forget_tenant(self, tenant: str) -> tuple[Removal, int]:
        """Forget every checkpoint and page of ``tenant``, in every namespace, for every node at
        once, and end its writes under way (none of them is recorded); remember when, so that
        explain can say so, and at which erasure epoch (the catalog's next: see
        ``erasure_epoch``). Returns every page (leased ones too: a forgotten tenant's bytes go)
        and that epoch."""
        check_tenant(tenant)
        now = self._clock()
        with self._db.write() as db:
            epoch = _latest_epoch(db) + 1
            ids = tuple(
                row["checkpoint_id"]
                for row in db.execute(
                    "SELECT checkpoint_id FROM checkpoints WHERE tenant = ? ORDER BY checkpoint_id",
                    (tenant,),
                ).fetchall()
            )
            db.execute(
                "INSERT INTO forgotten_tenants (tenant, forgotten_at, epoch) VALUES (?, ?, ?)"
                " ON CONFLICT (tenant) DO UPDATE SET forgotten_at = excluded.forgotten_at,"
                " epoch = excluded.epoch",
                (tenant, now, epoch),
            )
            db.executemany(
                "INSERT INTO forgotten_checkpoints (checkpoint_id, tenant, forgotten_at)"
                " VALUES (?, ?, ?) ON CONFLICT (checkpoint_id) DO NOTHING",
                [(cid, tenant, now) for cid in ids],
            )
            db.execute("DELETE FROM checkpoints WHERE tenant = ?", (tenant,))
            db.execute("DELETE FROM tenant_writes WHERE tenant = ?", (tenant,))
            pages = tuple(
                page_id(row)
                for row in db.execute(
                    "SELECT namespace, key FROM pages WHERE tenant = ?", (tenant,)
                ).fetchall()
            )
            db.execute("DELETE FROM pages WHERE tenant = ?", (tenant,))
        return Removal(ids, pages), epoch

    def erasure_epoch(self) -> int:
        """The catalog's erasure epoch: each forget begins the next one (0 before any). KV
        computed while a node knew epoch ``e`` was computed before every forget of a later
        epoch, so its write is refused for those tenants (``add_checkpoint``), on every node
        and whatever their clocks say."""
        with self._db.read() as db:
            return _latest_epoch(db)

    def forgotten_since(self, epoch: int) -> dict[str, int]:
        """The tenants forgotten after erasure epoch ``epoch``, with the epoch of their last
        forget (what another node erases from its RAM tier when it learns of it)."""
        with self._db.read() as db:
            return {
                row["tenant"]: int(row["epoch"])
                for row in db.execute(
                    "SELECT tenant, epoch FROM forgotten_tenants WHERE epoch > ?", (int(epoch),)
                )
            }

    def erased_at(self, tenant: str) -> int:
        """The erasure epoch of ``tenant``'s last forget (0: never forgotten since epochs were
        kept)."""
        with self._db.read() as db:
            return tenant_erased_at(db, check_tenant(tenant))

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
                "SELECT forgotten_at FROM forgotten_tenants WHERE tenant = ?",
                (check_tenant(tenant),),
            ).fetchone()
        return None if row is None else float(row["forgotten_at"])


def _latest_epoch(db: Transaction) -> int:
    row = db.execute("SELECT max(epoch) AS epoch FROM forgotten_tenants").fetchone()
    return 0 if row is None or row["epoch"] is None else int(row["epoch"])


def tenant_erased_at(db: Transaction, tenant: str) -> int:
    row = db.execute("SELECT epoch FROM forgotten_tenants WHERE tenant = ?", (tenant,)).fetchone()
    return 0 if row is None else int(row["epoch"])
