"""LocalPageMover: the manager's PageMover in one process, over a real PagePool and BlobStore.

Inside vLLM the connector queues the manager's copies as jobs for its workers; in the tests'
one process (a manager, or the control surface, without an engine) this mover does them at
once, so both calls return True and the manager never waits for `on_stored` / `on_persisted`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvci_plugin.tiering.blobs.folder import BlobStore
from kvci_plugin.tiering.ram.pool import PagePool
from kvci_plugin.tiering.types import PageKey, Reservation

PageSource = torch.Tensor | Mapping[PageKey, torch.Tensor]
"""The pages of a checkpoint: a ``(n_keys, slot_bytes)`` uint8 tensor in the checkpoint's key
order, or a mapping from page key to its ``(slot_bytes,)`` uint8 page."""


class LocalPageMover:
    """Copies pages into ``pool`` at once and writes blobs with ``blobs`` (None: RAM only)."""

    def __init__(self, pool: PagePool, blobs: BlobStore | None = None) -> None:
        if not isinstance(pool, PagePool):
            raise TypeError(f"pool must be a PagePool, not {type(pool).__name__}")
        if blobs is not None and not isinstance(blobs, BlobStore):
            raise TypeError(f"blobs must be a BlobStore or None, not {type(blobs).__name__}")
        self.pool = pool
        self.blobs = blobs

    def store(self, reservation: Reservation, source: PageSource) -> bool:
        """Copy the reservation's new pages from ``source`` into their slots."""
        if not reservation.new_keys:
            return True
        slots = list(reservation.new_slots)
        self.pool.write_many(slots, self._new_pages(reservation, source))
        return True

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool:
        """Write the pages in ``slots`` as the durable blobs of ``keys`` (fsynced on return)."""
        if self.blobs is None:
            raise RuntimeError(
                f"checkpoint {checkpoint_id}: this mover has no blob store, so nothing can be "
                "persisted")
        if len(keys) != len(slots):
            raise ValueError(f"keys and slots differ in length: {len(keys)} vs {len(slots)}")
        self.blobs.write_many(list(keys), tenant, self.pool.read_many(list(slots)))
        return True

    def _new_pages(self, reservation: Reservation, source: PageSource) -> torch.Tensor:
        slot_bytes = self.pool.slot_bytes
        if isinstance(source, torch.Tensor):
            n = len(reservation.slots)
            if source.dim() != 2 or source.shape[0] != n:
                raise ValueError(
                    f"source must be a (n_keys={n}, slot_bytes) tensor in key order, not of "
                    f"shape {tuple(source.shape)}")
            # reservation.slots lines up with the keys, and each distinct key has its own slot.
            row_of: dict[int, int] = {}
            for row, slot in enumerate(reservation.slots):
                row_of.setdefault(slot, row)
            rows = torch.as_tensor([row_of[slot] for slot in reservation.new_slots],
                                   dtype=torch.int64)
            return source.index_select(0, rows.to(source.device))
        if isinstance(source, Mapping):
            pages = []
            for key in reservation.new_keys:
                page = source.get(key)
                if page is None:
                    raise ValueError(f"source has no page for key {key.hex()}")
                if (not isinstance(page, torch.Tensor) or page.dtype != torch.uint8
                        or tuple(page.shape) != (slot_bytes,)):
                    raise ValueError(
                        f"source page of key {key.hex()} must be a uint8 tensor of shape "
                        f"({slot_bytes},)")
                pages.append(page)
            return torch.stack(pages)
        raise TypeError(
            f"source must be a tensor or a mapping of key to page, not {type(source).__name__}")
