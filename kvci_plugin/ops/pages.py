"""Whole-page byte copies between per-layer KV cache views and a host pool (layout-agnostic).

A layer is a 2-D uint8/int8 view ``(num_blocks, page_bytes_l)`` of that layer's KV cache (row
stride may exceed the page, bytes within a page are dense). A pool slot holds one block of every
layer, layer l at byte offset ``sum(page_bytes of layers before l)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvci_plugin.ops._native import kvci_ops


def pool_slot_bytes(layers: Sequence[torch.Tensor]) -> int:
    """Bytes one pool slot needs to hold one block of every layer."""
    return sum(int(layer.shape[1]) for layer in _layer_list(layers))


def gather_pages(
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    threads: int = 0,
) -> None:
    """Copy block ``block_ids[i]`` of every layer into pool slot ``slot_ids[i]``. ``threads``: on
    the CPU, at most this many copy threads, the caller's included (0: chosen by the copy's size
    and the host's cores)."""
    kvci_ops.gather_pages(
        _layer_list(layers),
        _tensor(block_ids, "block_ids"),
        _host_pool(pool),
        _tensor(slot_ids, "slot_ids"),
        _threads(threads),
    )


def scatter_pages(
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    threads: int = 0,
) -> None:
    """Copy pool slot ``slot_ids[i]`` back into block ``block_ids[i]`` of every layer.
    ``threads``: as for ``gather_pages``."""
    kvci_ops.scatter_pages(
        _host_pool(pool),
        _tensor(slot_ids, "slot_ids"),
        _layer_list(layers),
        _tensor(block_ids, "block_ids"),
        _threads(threads),
    )


def _layer_list(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError("layers must be a sequence of tensors, one per layer")
    if not layers:
        raise ValueError("layers must not be empty")
    for index, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise TypeError(f"layers[{index}] must be a tensor, not {type(layer).__name__}")
        if layer.dim() != 2:
            raise ValueError(
                f"layers[{index}] must be 2-D (num_blocks, page_bytes), "
                f"got shape {tuple(layer.shape)}"
            )
    return list(layers)


def _tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, not {type(value).__name__}")
    return value


def _threads(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"threads must be an int >= 0 (0: chosen by the copy's size), not {value!r}"
        )
    return value


def _host_pool(pool: object) -> torch.Tensor:
    tensor = _tensor(pool, "pool")
    if tensor.device.type != "cpu":
        raise ValueError(f"pool must be in host memory (a CPU tensor), got device {tensor.device}")
    return tensor
