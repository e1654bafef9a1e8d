"""RAMCheckpointStore: the RAM tier in one process, a ``RAMIndex`` joined to a ``PagePool``.

In vLLM the two halves live in different processes (the connector drives them); this class is
the in-process composition the tests use (never the product). Bounded by
entry count and bytes with LRU eviction at checkpoint granularity; every load is tenant-checked
and fails closed, so a checkpoint id handed to another tenant is worth nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.pool import PagePool
from kvci_plugin.tiering.types import CheckpointEntry, PageKey, RAMStats

DEFAULT_MAX_ENTRIES = 4096


class RAMCheckpointStore:
    """Checkpoints of whole pages in a host pool of ``ram_bytes // slot_bytes`` slots."""

    def __init__(
        self,
        ram_bytes: int,
        slot_bytes: int,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        tenant_quota_bytes: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        for name, value in (("ram_bytes", ram_bytes), ("slot_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, not {value}")
        if ram_bytes < slot_bytes:
            raise ValueError(
                f"ram_bytes ({ram_bytes}) is smaller than one slot ({slot_bytes} bytes): the RAM "
                "tier could not hold a single page"
            )
        num_slots = ram_bytes // slot_bytes
        self._index = RAMIndex(
            num_slots, slot_bytes, max_entries, tenant_quota_bytes=tenant_quota_bytes
        )
        self._pool = PagePool(num_slots, slot_bytes, pin_memory=pin_memory)

    @property
    def index(self) -> RAMIndex:
        return self._index

    @property
    def pool(self) -> PagePool:
        return self._pool

    @property
    def slot_bytes(self) -> int:
        return self._pool.slot_bytes

    def put(
        self,
        tenant: str,
        keys: Sequence[PageKey],
        pages: torch.Tensor,
        checkpoint_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Store ``pages[i]`` as page ``keys[i]`` of a new checkpoint; returns its id.

        Pages already held for the tenant are not copied again. Raises ``DoesNotFitError`` when
        the checkpoint cannot be made to fit (nothing is stored then).
        """
        keys = list(keys)
        if not isinstance(pages, torch.Tensor):
            raise TypeError(f"pages must be a tensor, not {type(pages).__name__}")
        if pages.dtype != torch.uint8 or tuple(pages.shape) != (len(keys), self.slot_bytes):
            raise ValueError(
                f"pages must be uint8 of shape ({len(keys)}, {self.slot_bytes}) (one row per "
                f"key), got {pages.dtype} of shape {tuple(pages.shape)}"
            )
        if checkpoint_id is None:
            checkpoint_id = uuid.uuid4().hex
        reservation = self._index.reserve(checkpoint_id, tenant, keys, meta)
        try:
            if reservation.new_keys:
                row_of = {}
                for row, key in enumerate(keys):
                    row_of.setdefault(key, row)
                rows = torch.as_tensor([row_of[k] for k in reservation.new_keys],
                                       dtype=torch.int64)
                self._pool.write_many(list(reservation.new_slots), pages.index_select(0, rows))
        except BaseException:
            self._index.abort(checkpoint_id)
            raise
        self._index.commit(checkpoint_id)
        return checkpoint_id

    def load(self, checkpoint_id: str, tenant: str) -> torch.Tensor:
        """The checkpoint's pages, ``(n, slot_bytes)`` uint8, in key order.

        Refuses (``TenantMismatchError``) a valid id of another tenant; ``CheckpointNotFoundError``
        for an id that is not held; ``PageNotFoundError`` if its bytes are not all in yet.
        """
        entry = self._index.get(checkpoint_id, tenant)
        return self._read(entry.keys, tenant)

    def longest_prefix(self, keys: Sequence[PageKey], tenant: str) -> int:
        return self._index.longest_prefix(keys, tenant)

    def load_prefix(self, keys: Sequence[PageKey], tenant: str) -> torch.Tensor:
        """The pages of the longest loadable prefix of ``keys`` (possibly none) for ``tenant``.

        Another thread may evict between the lookup and the load: ``PageNotFoundError`` then.
        """
        keys = list(keys)
        n = self._index.longest_prefix(keys, tenant)
        if n == 0:
            return torch.empty((0, self.slot_bytes), dtype=torch.uint8)
        return self._read(keys[:n], tenant)

    def get(self, checkpoint_id: str, tenant: str) -> CheckpointEntry:
        return self._index.get(checkpoint_id, tenant)

    def entries(self, tenant: str | None = None) -> list[CheckpointEntry]:
        return self._index.entries(tenant)

    def set_meta(self, checkpoint_id: str, **values: Any) -> None:
        self._index.set_meta(checkpoint_id, **values)

    def remove(self, checkpoint_id: str, tenant: str) -> None:
        """Drop a checkpoint; like a load, refused for a valid id of another tenant."""
        self._index.remove(checkpoint_id, tenant)

    def stats(self) -> RAMStats:
        return self._index.stats()

    def _read(self, keys: Sequence[PageKey], tenant: str) -> torch.Tensor:
        slots = self._index.pin(keys, tenant)
        try:
            return self._pool.read_many(slots)
        finally:
            self._index.unpin(keys)
