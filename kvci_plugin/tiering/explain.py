"""Why a checkpoint exists and where it is: its RAM entry, its live disk record, and the
tombstones of what a cache reset fenced or a forget erased, which explain names instead of
"not held"."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvci_plugin.tiering.disk.records import KVCheckpointRecord
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import (
    CheckpointEntry,
    CheckpointFencedError,
    CheckpointForgottenError,
    CheckpointNotFoundError,
    TenantMismatchError,
)

MAX_TOMBSTONES = 4096
"""RAM checkpoints a reset fenced (and, apart, a forget erased) that explain still names."""


class Tombstones:
    """The RAM checkpoints a cache reset fenced (tenant, when, generation begun) and a forget
    erased (tenant, when), the newest ``MAX_TOMBSTONES`` of each; the disk tier keeps its own
    in its catalog."""

    def __init__(self) -> None:
        self._fenced: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        self._forgotten: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __contains__(self, checkpoint_id: object) -> bool:
        """Whether a reset fenced or a forget erased the checkpoint: a copy of its KV still
        under way must never become loadable."""
        return checkpoint_id in self._fenced or checkpoint_id in self._forgotten

    def fence(self, held: Iterable[tuple[str, str]], when: float, generation: int) -> None:
        """A reset dropped ``held`` (checkpoint id, tenant)."""
        for checkpoint_id, tenant in held:
            self._fenced[checkpoint_id] = (tenant, when, generation)
        _trim(self._fenced)

    def forget(self, checkpoint_ids: Sequence[str], tenant: str, when: float) -> None:
        """A forget erased ``checkpoint_ids`` of ``tenant`` (only the newest are kept: the
        older would be trimmed at once)."""
        for checkpoint_id in checkpoint_ids[-MAX_TOMBSTONES:]:
            self._forgotten[checkpoint_id] = (tenant, when)
        _trim(self._forgotten)

    def raise_if_gone(self, checkpoint_id: str, tenant: str | None,
                      disk: KVCheckpointStore | None) -> None:
        """``CheckpointFencedError`` when a reset fenced the checkpoint, then
        ``CheckpointForgottenError`` when a forget erased it — in RAM or on the disk tier — and
        it is the caller's, if a tenant is named."""
        kinds = ((self._fenced, disk.fenced if disk is not None else None, CheckpointFencedError),
                 (self._forgotten, disk.forgotten if disk is not None else None,
                  CheckpointForgottenError))
        for held, on_disk, error in kinds:
            stone = held.get(checkpoint_id)
            if stone is None and on_disk is not None:
                stone = on_disk(checkpoint_id)
            if stone is not None and tenant in (None, stone[0]):
                raise error(checkpoint_id, *stone[1:])


def _trim(stones: OrderedDict[str, Any]) -> None:
    while len(stones) > MAX_TOMBSTONES:
        stones.popitem(last=False)


def ram_entry(index: RAMIndex, checkpoint_id: str, tenant: str | None) -> CheckpointEntry | None:
    """The RAM record, None when RAM does not hold it; another tenant's raises."""
    if tenant is not None:
        try:
            return index.get(checkpoint_id, tenant)
        except CheckpointNotFoundError:
            return None
    return index.find(checkpoint_id)  # operator tools: by id, whatever its tenant


def durable_record(disk: KVCheckpointStore | None, checkpoint_id: str, tenant: str | None,
                   now: float) -> KVCheckpointRecord | None:
    """The live disk record, None when there is none or its retention has passed; another
    tenant's raises (the message does not name its owner)."""
    if disk is None:
        return None
    record = disk.explain(checkpoint_id)
    if record is None or expired(record, now):
        return None
    if tenant is not None and record.tenant != tenant:
        raise TenantMismatchError(
            f"checkpoint {checkpoint_id!r} belongs to another tenant: refused")
    return record


def expired(record: KVCheckpointRecord, now: float) -> bool:
    """Whether ``record``'s retention has passed at ``now`` (it is no longer loadable)."""
    return record.retention_expiry is not None and record.retention_expiry <= now


def describe_ram(entry: CheckpointEntry, record: KVCheckpointRecord | None,
                 persisting: str | None) -> dict[str, Any]:
    """Explain's fields for a checkpoint RAM holds (``record``: its disk copy, if any;
    ``persisting``: where a persist of it is, if one is under way)."""
    return dict(
        tier="ram+disk" if record is not None else "ram", tenant=entry.tenant,
        trigger=entry.meta.get("trigger"), pages=len(entry.keys),
        bytes=entry.nbytes, created=entry.created, pending=entry.pending,
        persisting=persisting,
        source_ids=list(entry.meta.get("source_ids", ())),
        recommendation=json.loads(entry.meta.get("recommendation") or "null"),
        eligibility_decision=entry.meta.get("decision"),
        refusal=entry.meta.get("refusal"),
        persist_error=entry.meta.get("persist_error"),
        retention_expiry=None if record is None else record.retention_expiry,
        # Whether the turn ended on a tool call, and what was retained, how long, by whose word.
        tool_call=entry.meta.get("tool_call"), retention=entry.meta.get("retention"))


def describe_disk(record: KVCheckpointRecord) -> dict[str, Any]:
    """Explain's fields for a checkpoint only the disk tier holds."""
    return dict(
        tier="disk", tenant=record.tenant, trigger=record.trigger, pages=len(record.pages),
        bytes=record.nbytes, created=record.created, pending=False, persisting=None,
        retention_expiry=record.retention_expiry,
        recommendation=json.loads(record.recommendation_json),
        eligibility_decision=json.loads(record.decision_json), refusal=None,
        persist_error=None)
