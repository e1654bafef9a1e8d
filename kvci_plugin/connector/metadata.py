"""What crosses from the scheduler to the workers (and back) each step: picklable jobs only."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class LoadJob:
    """Copy RAM pool slots into the request's paged-cache blocks (before the forward)."""

    req_id: str
    slots: list[int]
    block_ids: list[int]


@dataclass(frozen=True)
class DiskLoadJob:
    """Read verified disk blobs into the request's blocks, asynchronously."""

    req_id: str
    tenant: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass(frozen=True)
class StoreJob:
    """Copy a finished request's blocks into RAM pool slots (its blocks are held until done)."""

    req_id: str
    checkpoint_id: str
    slots: list[int]
    block_ids: list[int]


@dataclass(frozen=True)
class PersistJob:
    """Write RAM pool slots to this rank's disk blobs; the scheduler records the catalog row
    only after every rank reported its shard durable."""

    checkpoint_id: str
    tenant: str
    keys: list[bytes]
    slots: list[int]


@dataclass
class KVCIMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    disk_loads: list[DiskLoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    persists: list[PersistJob] = field(default_factory=list)


@dataclass
class KVCIWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step outcome of persist jobs (summed over ranks) and of disk loads."""

    persisted: dict[str, int] = field(default_factory=dict)
    persist_errors: dict[str, list[str]] = field(default_factory=dict)
    # Disk pages a load found missing or corrupt: the scheduler forgets them.
    bad_pages: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVCIWorkerMetadata":
        assert isinstance(other, KVCIWorkerMetadata)
        out = KVCIWorkerMetadata(dict(self.persisted), {k: list(v) for k, v in self.persist_errors.items()},
                                 self.bad_pages + other.bad_pages)
        for cid, n in other.persisted.items():
            out.persisted[cid] = out.persisted.get(cid, 0) + n
        for cid, errs in other.persist_errors.items():
            out.persist_errors.setdefault(cid, []).extend(errs)
        return out
