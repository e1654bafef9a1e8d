"""The database under the checkpoint catalog: embedded SQLite, or PostgreSQL shared by nodes.

The catalog's SQL is written once, with ``?`` placeholders, in the subset both engines speak;
this module runs it on either. What differs is how a write excludes every other writer:

- SQLite: ``BEGIN IMMEDIATE`` takes the database's write lock (WAL, ``synchronous=FULL``); the
  file is one process's, as the disk store's folder lock ensures.
- PostgreSQL: every write transaction first takes one transaction-scoped advisory lock, so
  writes from all nodes are serialized exactly as SQLite's are, and the read-modify-write rules
  of the catalog (a page's tenant, the bound, leases) hold across nodes without retry loops.
  Reads run in REPEATABLE READ, READ ONLY transactions: one consistent snapshot per call.

Every wait is bounded (``DependencyTimeouts``): connecting, each statement, and the wait for a
lock (the advisory lock included) on PostgreSQL; the wait for the file's lock on SQLite. A
PostgreSQL connection the server ended (a restart, a terminated backend) is reopened: a call
that finds it broken before any statement of its caller ran starts again, once, on a new
connection; a failure after that is the call's.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol

from kvci_plugin.tiering.timeouts import DependencyTimeouts

try:
    import psycopg
    from psycopg.rows import dict_row
except ImportError:  # an optional dependency: only a postgresql:// catalog_url needs it
    psycopg = None  # type: ignore[assignment]

Dialect = Literal["sqlite", "postgresql"]
Row = dict[str, Any]
# The advisory lock every catalog write holds; the number is kvci's ("kvci" in ASCII).
_WRITE_LOCK_ID = 0x6B766369


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Row | None: ...

    def fetchall(self) -> list[Row]: ...

    def __iter__(self) -> Iterator[Row]: ...


class Transaction(Protocol):
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor: ...

    def executemany(self, sql: str, params: Sequence[Sequence[Any]]) -> None: ...


class CatalogDatabase(Protocol):
    dialect: Dialect

    def describe(self) -> str: ...

    def write(self) -> AbstractContextManager[Transaction]: ...

    def read(self) -> AbstractContextManager[Transaction]: ...

    def close(self) -> None: ...


def _dict_factory(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {column[0]: value for column, value in zip(cursor.description, row)}


class SQLiteDatabase:
    """One SQLite file in WAL mode, created 0600. Thread-safe; one process."""

    dialect: Dialect = "sqlite"

    def __init__(self, path: Path, timeouts: DependencyTimeouts = DependencyTimeouts()) -> None:
        self._path = Path(path)
        # Created 0600 before SQLite opens it; SQLite gives its -wal and -shm files the same mode.
        os.close(os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self._path, 0o600)
        self._lock = threading.RLock()
        self._depth = 0
        self._db = sqlite3.connect(self._path, timeout=timeouts.blob_s, isolation_level=None,
                                   check_same_thread=False)
        self._db.row_factory = _dict_factory
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()["journal_mode"]
        if mode != "wal":
            self._db.close()
            raise RuntimeError(f"{self._path}: SQLite refused WAL mode (got {mode!r})")
        # FULL: a commit is on disk when it returns, so "durable" means durable.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")

    @property
    def path(self) -> Path:
        return self._path

    def describe(self) -> str:
        return f"sqlite {self._path}"

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction; nested calls on the same thread join the outer one."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")
            finally:
                self._depth = 0

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _PostgresTransaction:
    """Runs the catalog's ``?`` SQL on a psycopg connection."""

    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self._conn = conn

    @staticmethod
    def _sql(sql: str) -> str:
        if "%" in sql:
            raise ValueError("catalog SQL must not contain '%'")
        return sql.replace("?", "%s")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Row]:
        return self._conn.execute(self._sql(sql), tuple(params))

    def executemany(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        rows = [tuple(p) for p in params]
        if rows:
            with self._conn.cursor() as cur:
                cur.executemany(self._sql(sql), rows)


class PostgresDatabase:
    """A PostgreSQL database shared by every node. Thread-safe."""

    dialect: Dialect = "postgresql"

    def __init__(self, url: str, timeouts: DependencyTimeouts = DependencyTimeouts()) -> None:
        if psycopg is None:
            raise RuntimeError(
                "catalog_url names PostgreSQL but psycopg is missing: pip install 'kvci[shared]'"
            )
        if not url.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"catalog_url must start with postgresql://, not {url!r}")
        self._url = url
        self._timeouts = timeouts
        self._lock = threading.RLock()
        self._depth = 0
        self._conn = self._connect()
        info = self._conn.info
        self._where = f"postgresql {info.host}:{info.port}/{info.dbname}"

    def _connect(self) -> psycopg.Connection[Row]:
        t = self._timeouts
        conn = psycopg.connect(self._url, autocommit=True, row_factory=dict_row,
                               connect_timeout=t.postgres_connect_s)
        try:
            # Set for the session rather than as startup options, which would replace any
            # `options` the operator's URL gives.
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false),"
                " set_config('lock_timeout', %s, false)",
                (_milliseconds(t.statement_s), _milliseconds(t.lock_s)),
            )
        except BaseException:
            conn.close()
            raise
        return conn

    def _live(self) -> psycopg.Connection[Row]:
        if self._conn.closed:
            self._conn = self._connect()
        return self._conn

    def describe(self) -> str:
        return self._where  # never the URL: it may carry a password

    @contextmanager
    def _transaction(self, first: str,
                     params: tuple[Any, ...] = ()) -> Iterator[_PostgresTransaction]:
        """A transaction that runs ``first`` before the caller's statements.

        A connection the server ended while it sat idle shows it only when next used: here, at
        the transaction's start or its ``first`` statement, before anything of the caller's ran.
        The transaction then starts again, once, on a new connection. A failure once the caller
        has the transaction is the caller's: nothing is run twice.
        """
        for last_try in (False, True):
            conn = self._live()
            began = False
            try:
                with conn.transaction():
                    conn.execute(first, params)
                    began = True
                    yield _PostgresTransaction(conn)
                return
            except psycopg.OperationalError:
                if began or last_try or not conn.closed:
                    raise

    @contextmanager
    def write(self) -> Iterator[_PostgresTransaction]:
        """A write transaction holding the catalog's advisory lock (waited for at most
        ``lock_s``: ``lock_timeout`` bounds advisory locks too); nested calls join it."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield _PostgresTransaction(self._conn)
                finally:
                    self._depth -= 1
                return
            self._depth = 1
            try:
                with self._transaction("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK_ID,)) as tx:
                    yield tx
            finally:
                self._depth = 0

    @contextmanager
    def read(self) -> Iterator[_PostgresTransaction]:
        with self._lock:
            if self._depth:
                yield _PostgresTransaction(self._conn)
                return
            with self._transaction(
                "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
            ) as tx:
                yield tx

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _milliseconds(seconds: float) -> str:
    """A PostgreSQL timeout setting: whole milliseconds, at least 1 (0 would mean none)."""
    return str(max(1, round(seconds * 1000)))


def open_catalog_database(
    catalog_url: str | None, sqlite_path: Path | None,
    timeouts: DependencyTimeouts = DependencyTimeouts(),
) -> CatalogDatabase:
    """PostgreSQL when ``catalog_url`` is given, else the SQLite file ``sqlite_path``."""
    if catalog_url is not None:
        return PostgresDatabase(catalog_url, timeouts)
    if sqlite_path is None:
        raise ValueError("a catalog needs catalog_url or a SQLite path")
    return SQLiteDatabase(sqlite_path, timeouts)
