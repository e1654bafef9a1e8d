"""The SQL the catalog's reads, removals, fences and eviction share: which pages no checkpoint
references or no live lease holds, IN lists cut to size, and a record read back from its rows."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvci_plugin.tiering.disk.db import Row, Transaction
from kvci_plugin.tiering.disk.records import KVCheckpointRecord, PageId, PageRef

UNREFERENCED = (
    "NOT EXISTS (SELECT 1 FROM checkpoint_pages AS cp"
    " WHERE cp.namespace = p.namespace AND cp.key = p.key)"
)
# Takes one parameter, the time now.
UNLEASED = (
    "NOT EXISTS (SELECT 1 FROM blob_leases AS l"
    " WHERE l.namespace = p.namespace AND l.key = p.key AND l.expiry > ?)"
)
# Keeps each IN (...) list well under SQLite's bound on host parameters.
CHUNK = 500


def page_id(row: Row) -> PageId:
    return PageId(bytes.fromhex(row["namespace"]), bytes.fromhex(row["key"]))


def chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def marks(n: int) -> str:
    return ",".join("?" * n)


def read_record(db: Transaction, checkpoint_id: str) -> KVCheckpointRecord | None:
    """The record of ``checkpoint_id`` with its pages in order, None when there is none."""
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


def delete_page_if_unreferenced(db: Transaction, page: PageId) -> bool:
    return bool(
        db.execute(
            f"DELETE FROM pages AS p WHERE namespace = ? AND key = ? AND {UNREFERENCED}",
            (page.namespace.hex(), page.key.hex()),
        ).rowcount
    )


def unleased(db: Transaction, pages: Sequence[PageId], now: float) -> tuple[PageId, ...]:
    """``pages`` less those under a live lease: their blobs are another writer's now."""
    return tuple(
        page
        for page in pages
        if db.execute(
            "SELECT 1 AS found FROM blob_leases WHERE namespace = ? AND key = ? AND expiry > ?",
            (page.namespace.hex(), page.key.hex(), now),
        ).fetchone()
        is None
    )
