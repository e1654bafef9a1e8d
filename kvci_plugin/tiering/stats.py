"""What the control surface's ``ram_stats`` tells: the RAM tier's counts (read from counters the
index keeps, never a walk under its lock), its retentions, and the disk tier's counts and health."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.records import DiskStats
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.ram.retention import RetentionStats
from kvci_plugin.tiering.types import RAMStats


def tier_stats(s: RAMStats, persists: int, r: RetentionStats, *, gate: str,
               scorers: dict[str, float], disk: KVCheckpointStore | None,
               disk_attach: DiskAttach | None) -> dict[str, Any]:
    """The tiers' figures as one JSON-ready mapping."""
    return {
        "entries": s.entries,
        "pending_entries": s.pending_entries,
        "pages": s.pages,
        "pinned_pages": s.pinned_pages,
        "bytes_used": s.bytes_used,
        "capacity_bytes": s.capacity_bytes,
        "max_entries": s.max_entries,
        "slot_bytes": s.slot_bytes,
        "evictions": s.evictions,
        "policy": asdict(s.policy),
        "tenant_bytes": dict(s.tenant_bytes),
        "tenant_quota_bytes": s.tenant_quota_bytes,
        "persists_in_flight": persists,
        "retentions": r.retentions,
        "retained_bytes": r.retained_bytes,
        "tenant_retained_bytes": r.tenant_retained_bytes,
        "retentions_expired": r.expired,
        "retentions_released": r.released,
        "gate_in_force": gate,
        "scorers": scorers,
        "disk": _disk_stats(disk) if disk is not None else None if disk_attach is None else {
            **{f.name: None for f in fields(DiskStats)},
            "health": asdict(disk_attach.report()),
        },
    }


def _disk_stats(disk: KVCheckpointStore) -> dict[str, Any]:
    """The disk tier's counts and health; while its catalog does not answer, its health alone
    (the counts are None)."""
    try:
        counts = asdict(disk.stats())
    except Exception:  # degraded, or failing now: the health says which and since when
        counts = {f.name: None for f in fields(DiskStats)}
    return {**counts, "health": asdict(disk.health_report())}
