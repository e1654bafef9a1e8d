"""The disk tier's records: a durable checkpoint and its pages, what a catalog call removed, and
what the tier's maintenance (reconcile, reset, forget) and occupancy report.

Plain values: the catalog (``disk.catalog``) makes and reads them, the tier (``disk.tier``)
returns them, the manager and the control surface show them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvci_plugin.tiering.types import PageKey

_HEX_KEY = r"^[0-9a-f]{32}$"
_HEX_NAMESPACE = r"^[0-9a-f]{64}$"


class PageRef(BaseModel):
    """One page of a checkpoint: its key and the size of its blob on disk."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    key: str = Field(pattern=_HEX_KEY)
    nbytes: int = Field(gt=0)


class KVCheckpointRecord(BaseModel):
    """A durable KV checkpoint and why it exists (the seed's :KVCheckpoint node).

    Times are Unix seconds. ``recommendation_json`` and ``decision_json`` (the eligibility
    decision with its derivation) are JSON texts kept verbatim for explain surfaces.
    ``slot_bytes`` is the payload size of each page; ``PageRef.nbytes`` the blob's file size,
    which is what the disk bound counts.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    checkpoint_id: str = Field(min_length=1, max_length=256)
    tenant: str = Field(min_length=1)
    namespace: str = Field(pattern=_HEX_NAMESPACE)
    trigger: Literal["user", "agent", "system"]
    recommendation_json: str
    decision_json: str
    created: float
    retention_expiry: float | None
    last_used: float
    slot_bytes: int = Field(gt=0)
    pages: tuple[PageRef, ...] = Field(min_length=1)

    @field_validator("recommendation_json", "decision_json")
    @classmethod
    def _is_json(cls, value: str) -> str:
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be JSON text: {exc}") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KVCheckpointRecord:
        keys = [page.key for page in self.pages]
        if len(set(keys)) != len(keys):
            raise ValueError("pages: a page key appears twice")
        if self.retention_expiry is not None and self.retention_expiry <= self.created:
            raise ValueError("retention_expiry must be later than created")
        if self.last_used < self.created:
            raise ValueError("last_used must not be earlier than created")
        return self

    @property
    def page_keys(self) -> tuple[PageKey, ...]:
        return tuple(bytes.fromhex(page.key) for page in self.pages)

    @property
    def nbytes(self) -> int:
        return sum(page.nbytes for page in self.pages)


@dataclass(frozen=True)
class PageId:
    """A page row: its namespace and key."""

    namespace: bytes
    key: PageKey


@dataclass(frozen=True)
class Removal:
    """What a catalog call removed; the caller deletes the blob files of ``pages``."""

    checkpoint_ids: tuple[str, ...] = ()
    pages: tuple[PageId, ...] = ()

    def __add__(self, other: Removal) -> Removal:
        return Removal(self.checkpoint_ids + other.checkpoint_ids, self.pages + other.pages)


@dataclass(frozen=True)
class CatalogStats:
    checkpoints: int
    pages: int
    unreferenced_pages: int
    bytes_used: int
    unreferenced_bytes: int


@dataclass(frozen=True)
class ReconcileReport:
    """What start-up reconciliation found and repaired."""

    temp_files: int
    orphan_blobs: int
    lost: Removal
    """Pages whose blob had vanished, and the checkpoints that needed them."""
    expired: Removal
    evicted: Removal


@dataclass(frozen=True)
class GenerationFence:
    """What a cache reset did to the disk tier: the generation begun, the checkpoints fenced."""

    generation: int
    checkpoint_ids: tuple[str, ...]


@dataclass(frozen=True)
class ForgetReport:
    """What a forget erased from the disk tier."""

    checkpoint_ids: tuple[str, ...]
    pages: int
    key_destroyed: bool
    """Whether key material existed (a tenant that never wrote has none)."""
    erasure_epoch: int = 0
    """The catalog's erasure epoch this forget began (``CheckpointCatalog.erasure_epoch``)."""


@dataclass(frozen=True)
class DiskStats:
    """Occupancy of the disk tier. Numbers only."""

    checkpoints: int
    pages: int
    unreferenced_pages: int
    bytes_used: int
    capacity_bytes: int
    quarantined: int
