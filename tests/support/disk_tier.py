"""DiskTierForTests: the disk tier with whole-checkpoint writes and reads in one process.

In vLLM a persist is split between processes — the scheduler leases the pages
(``KVCheckpointStore.reserve``), the workers write the blobs (``BlobBackend.write_many``), the
scheduler records the row (``record_written``) — and a load is the workers' ``read_many`` after
the scheduler's lookup. These methods do both halves in one call, so that a test can write and
read a checkpoint through one object; the product never calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvci_plugin.tiering.blobs.errors import BlobUnavailableError
from kvci_plugin.tiering.disk.calls import bounded, direct
from kvci_plugin.tiering.disk.records import KVCheckpointRecord
from kvci_plugin.tiering.disk.tier import KVCheckpointStore, _check_keys
from kvci_plugin.tiering.types import CheckpointNotFoundError, PageKey


class DiskTierForTests(KVCheckpointStore):
    """A ``KVCheckpointStore`` that also persists and loads whole checkpoints itself."""

    @direct
    def persist(
        self,
        checkpoint_id: str,
        tenant: str,
        keys: Sequence[PageKey],
        pages: torch.Tensor,
        trigger: Literal["user", "agent", "system"],
        recommendation_json: str,
        decision_json: str,
        retention_expiry: float | None,
    ) -> KVCheckpointRecord:
        """Write a checkpoint the eligibility gate has permitted: blobs, then its catalog row.

        ``pages[i]`` is the page of ``keys[i]``. Returns the record as stored. Older
        checkpoints may be evicted to stay within ``disk_bytes``.
        """
        keys = _check_keys(keys)
        pages = _check_pages(pages, len(keys))
        record = self._new_record(
            checkpoint_id, tenant, keys, pages.shape[1], trigger, recommendation_json,
            decision_json, retention_expiry,
        )
        self.reserve(checkpoint_id, keys, tenant)
        try:
            self._blobs.write_many(keys, tenant, pages)
        except BaseException:
            self._abandon(checkpoint_id, keys)
            raise
        return self._record(record, lambda: [self._blob_size(k) for k in keys])

    @direct
    def load(self, checkpoint_id: str, tenant: str) -> torch.Tensor:
        """The pages of ``tenant``'s checkpoint as a (pages, slot_bytes) uint8 tensor.

        Refuses another tenant's valid id (``TenantMismatchError``) and a checkpoint of another
        namespace (``CheckpointNotFoundError``: its KV belongs to another model or layout). A
        page that fails verification raises ``BlobUnavailableError`` and is forgotten along with
        the checkpoints that need it.
        """
        record = self._catalog.get(checkpoint_id, tenant)
        if record.namespace != self._namespace.hex():
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id} belongs to another namespace (model, KV layout or "
                "format)"
            )
        keys = record.page_keys
        out = torch.empty((len(keys), record.slot_bytes), dtype=torch.uint8)
        loaded, error = self._read_many(keys, tenant, out)
        if error is not None:
            raise error
        self._catalog.touch(self._namespace, keys)
        return out[:loaded]

    @direct
    def load_prefix(self, keys: Sequence[PageKey], tenant: str) -> torch.Tensor:
        """The longest loadable prefix of ``keys`` for ``tenant`` as a (n, slot_bytes) tensor.

        Stops at the first page that fails verification (which is forgotten); (0, 0) when no
        page loads.
        """
        keys = _check_keys(keys)
        n = self.longest_prefix(keys, tenant)
        if n == 0:
            return torch.empty((0, 0), dtype=torch.uint8)
        try:
            first = self._blobs.read(keys[0], tenant)
        except BlobUnavailableError:
            self.discard(keys[:1])
            return torch.empty((0, 0), dtype=torch.uint8)
        out = torch.empty((n, first.numel()), dtype=torch.uint8)
        out[0].copy_(first)
        loaded, _ = self._read_many(keys[1:n], tenant, out[1:])
        loaded += 1
        self._catalog.touch(self._namespace, keys[:loaded])
        return out[:loaded]

    @bounded("listing checkpoints")
    def list(self, tenant: str | None = None) -> list[KVCheckpointRecord]:
        """Checkpoint records, oldest first, optionally of one tenant only."""
        return self._catalog.list(tenant)

    def _read_many(
        self, keys: Sequence[PageKey], tenant: str, out: torch.Tensor
    ) -> tuple[int, Exception | None]:
        loaded, error = self._blobs.read_many(keys, tenant, out)
        if isinstance(error, BlobUnavailableError):
            self.discard([keys[loaded]])
        return loaded, error


def _check_pages(pages: object, n: int) -> torch.Tensor:
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"pages must be a torch.Tensor, not {type(pages).__name__}")
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.device.type != "cpu":
        raise ValueError(
            f"pages must be a 2-D uint8 CPU tensor, not {pages.dim()}-D {pages.dtype} on "
            f"{pages.device}"
        )
    if pages.shape[0] != n or pages.shape[1] == 0:
        raise ValueError(f"pages must have shape ({n}, slot_bytes > 0), not {tuple(pages.shape)}")
    return pages
