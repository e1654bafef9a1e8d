"""How long the disk tier waits on each of its dependencies (a catalog database, a blob store).

kvci is an optimization: a dependency that does not answer in time makes a call fail (a miss, a
dropped write), it never stalls the engine. Every wait on the network has one of these bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DependencyTimeouts:
    """Seconds, each finite and > 0."""

    connect_s: float = 2.0
    """Opening a connection: PostgreSQL's ``connect_timeout`` (whole seconds, at least 2: libpq
    counts no less) and Redis's socket connect timeout."""
    statement_s: float = 2.0
    """One statement of the PostgreSQL catalog (``statement_timeout``)."""
    lock_s: float = 1.0
    """A wait for a lock in the PostgreSQL catalog (``lock_timeout``), the advisory lock that
    serializes every node's catalog writes included."""
    blob_s: float = 2.0
    """One Redis request (its socket timeout); also how long the embedded SQLite catalog waits
    for its file's lock."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(
                    f"{field.name} must be a finite number of seconds > 0, not {value!r}")

    @property
    def postgres_connect_s(self) -> int:
        """``connect_s`` as libpq counts it: whole seconds, at least 2."""
        return max(2, math.ceil(self.connect_s))
