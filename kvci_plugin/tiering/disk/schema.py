"""The catalog's schema: its migrations in order, in SQLite's words (``migration_sql`` gives
PostgreSQL's), and the step that brings a database up to date. The same schema, migrations and
SQL run on both engines (``disk.db``)."""

from __future__ import annotations

from kvci_plugin.tiering.disk.db import CatalogDatabase, Dialect

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
    (
        # Each write under way and its tenant: a forget deletes its tenant's, so a write begun
        # before it is never recorded after it, on any node, whatever the nodes' clocks say.
        """CREATE TABLE tenant_writes (
            holder TEXT PRIMARY KEY,
            tenant TEXT NOT NULL
        ) WITHOUT ROWID""",
        "CREATE INDEX tenant_writes_by_tenant ON tenant_writes (tenant)",
    ),
    (
        # The erasure epoch of each tenant's last forget (the catalog's epoch is the latest):
        # KV computed while a node knew an older epoch is never recorded for that tenant, and
        # other nodes learn from it which tenants to erase from their RAM tiers.
        "ALTER TABLE forgotten_tenants ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX forgotten_tenants_by_epoch ON forgotten_tenants (epoch)",
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


def migrate(database: CatalogDatabase) -> None:
    """Apply the migrations ``database`` lacks, in one write transaction; a schema newer than
    this kvci understands is refused."""
    with database.write() as db:
        db.execute(migration_sql(
            "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
            database.dialect,
        ))
        row = db.execute("SELECT version FROM schema_version").fetchone()
        version = 0 if row is None else row["version"]
        if version > len(MIGRATIONS):
            raise RuntimeError(
                f"{database.describe()}: catalog schema version {version} is newer than this "
                f"kvci understands ({len(MIGRATIONS)})"
            )
        for statements in MIGRATIONS[version:]:
            for statement in statements:
                db.execute(migration_sql(statement, database.dialect))
        if row is None:
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (len(MIGRATIONS),))
        else:
            db.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS),))
