"""The disk tier's eviction, written as SQL: what leaves when the pages exceed ``disk_bytes``.

Pages no live checkpoint references (left behind when their checkpoint was evicted or lost a
page) are a prefix cache: they go first, least recently used first. If the pages of live
checkpoints alone exceed the bound, whole checkpoints go — those of tenants holding more than
their fair share first (``disk_bytes`` split among the tenants holding pages), least recently
used first — and their now-unreferenced pages then join the LRU. Dropping whole checkpoints
keeps every remaining record fully loadable; a bound that pinned records could overrun would
not be a bound. A page under a live lease is never chosen, nor the checkpoint just written.
"""

from __future__ import annotations

from kvci_plugin.tiering.disk.db import Transaction
from kvci_plugin.tiering.disk.records import PageId, Removal
from kvci_plugin.tiering.disk.sql import CHUNK, UNLEASED, UNREFERENCED, page_id


def evict(db: Transaction, disk_bytes: int, protect: str | None, now: float) -> Removal:
    """In the write transaction ``db``: drop pages, then whole checkpoints if need be, until the
    pages take <= ``disk_bytes`` (see ``CheckpointCatalog.evict_to``)."""
    checkpoint_ids: list[str] = []
    pages: list[PageId] = []
    held = {row["tenant"]: int(row["held"]) for row in db.execute(
        "SELECT tenant, CAST(sum(bytes) AS BIGINT) AS held FROM pages GROUP BY tenant"
    ).fetchall()}
    total = sum(held.values())
    while total > disk_bytes:
        batch = db.execute(
            f"SELECT namespace, key, bytes, tenant FROM pages AS p WHERE {UNREFERENCED}"
            f" AND {UNLEASED} ORDER BY last_used, namespace, key LIMIT ?",
            (now, CHUNK),
        ).fetchall()
        for row in batch:
            if total <= disk_bytes:
                break
            db.execute(
                "DELETE FROM pages WHERE namespace = ? AND key = ?",
                (row["namespace"], row["key"]),
            )
            pages.append(page_id(row))
            total -= row["bytes"]
            held[row["tenant"]] -= row["bytes"]
        if batch:
            continue
        victim = eviction_victim(db, held, disk_bytes, protect)
        if victim is None:
            break
        db.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (victim,))
        checkpoint_ids.append(victim)
    return Removal(tuple(checkpoint_ids), tuple(pages))


def eviction_victim(db: Transaction, held: dict[str, int], disk_bytes: int,
                     protect: str | None) -> str | None:
    """The least recently used checkpoint of a tenant past its fair share, else of anyone."""
    tenants = [t for t, n in held.items() if n > 0]
    share = disk_bytes // max(1, len(tenants))
    over = [t for t in tenants if held[t] > share]
    skip = ("checkpoint_id <> ?", (protect,)) if protect is not None else ("1 = 1", ())
    choices = [(f"tenant IN ({', '.join('?' * len(over))})", tuple(over))] if over else []
    for where, params in [*choices, ("1 = 1", ())]:
        row = db.execute(
            f"SELECT checkpoint_id FROM checkpoints WHERE {where} AND {skip[0]}"
            " ORDER BY last_used, created, checkpoint_id LIMIT 1",
            (*params, *skip[1]),
        ).fetchone()
        if row is not None:
            return row["checkpoint_id"]
    return None
