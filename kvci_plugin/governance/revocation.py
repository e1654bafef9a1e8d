"""The revocation list: credential ids (jti) that no longer grant anything, in SQLite."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS revocations (
    jti TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    revoked_at REAL NOT NULL
)
"""


class RevocationList:
    """Consulted on every credential verification, so a revocation takes effect at the next check.

    Each call opens its own connection: the list is shared between processes (engine, CLI) and
    must always read what was last committed.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self._connect() as conn:
            conn.execute(_SCHEMA)

    def revoke(self, jti: str, reason: str) -> None:
        """Revoke credential `jti`. Revoking twice keeps the first reason and time."""
        if not jti:
            raise ValueError("jti must be a non-empty string")
        if not reason:
            raise ValueError("reason must be a non-empty string")
        with self._connect() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO revocations (jti, reason, revoked_at) VALUES (?, ?, ?)",
                (jti, reason, time.time()),
            )

    def is_revoked(self, jti: str) -> bool:
        return self.reason(jti) is not None

    def reason(self, jti: str) -> str | None:
        """Why `jti` was revoked, or None when it is not revoked."""
        with self._connect() as conn:
            row = conn.execute("SELECT reason FROM revocations WHERE jti = ?", (jti,)).fetchone()
        return None if row is None else str(row[0])

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=10.0)) as conn, conn:
            yield conn
