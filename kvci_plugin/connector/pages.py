"""Byte-page views of vLLM's KV cache tensors, whatever their dtype and layout.

kvci copies whole pages as bytes, in memory order, and never splits a page into K/V rows: on CPU
a page is `(heads, 2 * block_size, head_size)` with K rows then V rows, not per-token K‖V. vLLM
hands each layer over as a logical `[blocks, heads, tokens, content]` view whose strides follow
the resolved KV cache layout (on CUDA the default, LBNHC, keeps tokens outside heads in memory),
and may count kernel blocks, several per block. The layout, dtype and block size are part of the
namespace, so pages never cross layouts.
"""

from __future__ import annotations

import torch


def page_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """One 2-D uint8 view `(num_blocks, page_bytes)` per page-contiguous region, in layer order.

    Layer tensors with blocks (or kernel blocks) outermost give one view; tensors with K and V
    outermost (`(2, num_blocks, ...)`) give two. A block whose bytes are not one dense run (a
    layout with heads outside blocks) is refused rather than copied wrongly.
    """
    views: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        for part in _block_major(name, t, num_blocks):
            views.append(_dense_pages(name, part))
    return views


def slot_bytes(views: list[torch.Tensor]) -> int:
    """Bytes of one RAM slot: every layer's page of one block, back to back."""
    return sum(v.shape[1] for v in views)


def _block_major(name: str, t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The tensors of this layer whose dim 0 is vLLM's block."""
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        return [t]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [t[0], t[1]]
    if t.dim() >= 2 and t.shape[0] % num_blocks == 0:
        return [t.unflatten(0, (num_blocks, -1))]  # kernel blocks, grouped by block
    raise ValueError(
        f"kvci: unsupported KV cache layout for layer {name}: shape {tuple(t.shape)} "
        f"with {num_blocks} blocks"
    )


def _dense_pages(name: str, t: torch.Tensor) -> torch.Tensor:
    """`(num_blocks, page_bytes)` uint8 over ``t``, each row a block's bytes in memory order."""
    memory_order = sorted(range(1, t.dim()), key=t.stride, reverse=True)
    pages = t.permute(0, *memory_order)
    if not pages[0].is_contiguous():
        raise ValueError(
            f"kvci: the pages of layer {name} are not dense in memory (shape {tuple(t.shape)}, "
            f"strides {t.stride()}): kvci needs each block's bytes together; use a layout with "
            "blocks outside heads (VLLM_KV_CACHE_LAYOUT=LBNHC, LBHNC, BLNHC or BLHNC)"
        )
    return pages.view(pages.shape[0], -1).view(torch.uint8)  # a view: never a copy
