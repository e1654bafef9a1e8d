"""Helpers shared by the disk-tier tests (catalog and store); imported by name, as tests/ is on
the pytest path."""

from __future__ import annotations

import hashlib

T0 = 1_800_000_000.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(name: str) -> bytes:
    """A 16-byte page key named `name`."""
    return hashlib.sha256(name.encode()).digest()[:16]
