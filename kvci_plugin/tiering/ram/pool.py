"""PagePool: the bytes half of the RAM tier, a host buffer of fixed-size page slots.

It lives in the worker process next to the KV cache; ``RAMIndex`` (scheduler side) decides which
slot holds which page. One slot holds one block of every layer, the layers' pages back to back,
so a slot is ``slot_bytes_for(layers)`` bytes. The buffer is page-locked when CUDA is available
so that copies to and from the GPU can run asynchronously.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from kvci_plugin.ops import gather_pages, pool_slot_bytes, scatter_pages


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, not {value}")
    return value


def _index_tensor(name: str, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be a 1-D int64 or int32 tensor")
        return ids
    return torch.as_tensor(list(ids), dtype=torch.int64)


def _page_lock(owner: object, buffer: torch.Tensor) -> None:
    """Page-lock ``buffer`` for the GPU's copies, exactly its bytes, until ``owner`` is gone.

    Not ``pin_memory=True``: torch's pinned allocator rounds every allocation up to a power of
    two, so a 40 GiB pool would lock 64 GiB of host memory.
    """
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
    if error.value != 0:
        raise RuntimeError(f"kvci: could not page-lock the {buffer.nbytes}-byte RAM tier "
                           f"(cudaHostRegister error {error.value}); lower ram_bytes")
    # The finalizer keeps the buffer alive until it has unregistered it.
    weakref.finalize(owner, lambda: cudart.cudaHostUnregister(buffer.data_ptr()))


class PagePool:
    """``num_slots`` page slots of ``slot_bytes`` each, in one uint8 tensor."""

    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool | None = None) -> None:
        _positive_int("num_slots", num_slots)
        _positive_int("slot_bytes", slot_bytes)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool or None, not {type(pin_memory).__name__}")
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise ValueError("pin_memory=True needs CUDA, and torch.cuda.is_available() is False")
        pin = cuda if pin_memory is None else pin_memory
        self._pool = torch.empty((num_slots, slot_bytes), dtype=torch.uint8)
        self._pinned = pin
        if pin:
            _page_lock(self, self._pool)

    @property
    def num_slots(self) -> int:
        return self._pool.shape[0]

    @property
    def slot_bytes(self) -> int:
        return self._pool.shape[1]

    @property
    def pinned(self) -> bool:
        return self._pinned

    @property
    def pages(self) -> torch.Tensor:
        """The slots' bytes, a row a slot: for copies that take a layer's part of each row."""
        return self._pool

    @staticmethod
    def slot_bytes_for(layers: Sequence[torch.Tensor]) -> int:
        """Bytes of one slot for these 2-D layer views: one page of every layer."""
        return pool_slot_bytes(layers)

    def store(
        self,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        slot_ids: Sequence[int] | torch.Tensor,
    ) -> None:
        """Copy whole pages: block ``block_ids[i]`` of every layer into slot ``slot_ids[i]``."""
        blocks, slots = self._check_copy(layers, block_ids, slot_ids)
        gather_pages(list(layers), blocks, self._pool, slots)

    def load(
        self,
        slot_ids: Sequence[int] | torch.Tensor,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
    ) -> None:
        """Copy slot ``slot_ids[i]`` back into block ``block_ids[i]`` of every layer."""
        blocks, slots = self._check_copy(layers, block_ids, slot_ids)
        scatter_pages(self._pool, slots, list(layers), blocks)

    def read(self, slot: int) -> torch.Tensor:
        """A copy of one slot's bytes (the slot may be reused once its page is unpinned)."""
        return self._pool[self._check_slot(slot)].clone()

    def write(self, slot: int, data: torch.Tensor) -> None:
        self._check_rows("data", data, None)
        self._pool[self._check_slot(slot)].copy_(data)

    def read_many(self, slot_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """A copy of the slots' bytes, one row per slot id: ``(n, slot_bytes)`` uint8."""
        return self._pool.index_select(0, self._check_slots(slot_ids))

    def write_many(self, slot_ids: Sequence[int] | torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``pages[i]`` into slot ``slot_ids[i]``; the slot ids must be distinct."""
        slots = self._check_slots(slot_ids)
        self._check_rows("pages", pages, len(slots))
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slot_ids must be distinct: each slot may be written once")
        self._pool.index_copy_(0, slots, pages.to(self._pool.device))

    # ---- checks ----

    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, not {type(slot).__name__}")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is out of range for a pool of {self.num_slots} slots")
        return slot

    def _check_slots(self, slot_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        slots = _index_tensor("slot_ids", slot_ids).to(torch.int64)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise IndexError(f"slot_ids out of range for a pool of {self.num_slots} slots")
        return slots

    def _check_rows(self, name: str, data: torch.Tensor, rows: int | None) -> None:
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, not {type(data).__name__}")
        shape = (self.slot_bytes,) if rows is None else (rows, self.slot_bytes)
        if data.dtype != torch.uint8 or tuple(data.shape) != shape:
            raise ValueError(
                f"{name} must be uint8 of shape {shape}, got {data.dtype} of shape "
                f"{tuple(data.shape)}"
            )

    def _check_copy(
        self,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        slot_ids: Sequence[int] | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.slot_bytes_for(layers)
        if need != self.slot_bytes:
            raise ValueError(
                f"layers: one page of every layer is {need} bytes, the pool's slots are "
                f"{self.slot_bytes}"
            )
        blocks = _index_tensor("block_ids", block_ids)
        slots = _index_tensor("slot_ids", slot_ids)
        if blocks.numel() != slots.numel():
            raise ValueError(
                f"block_ids and slot_ids differ in length: {blocks.numel()} vs {slots.numel()}"
            )
        return blocks, slots
