"""Byte-page views of vLLM's KV cache tensors, whatever their dtype and layout.

kvci copies whole pages as bytes and never splits a page into K/V rows: on CPU a page is
`(heads, 2 * block_size, head_size)` with K rows then V rows, not per-token K‖V. The layout,
dtype and block size are part of the namespace, so pages never cross layouts.
"""

from __future__ import annotations

import torch


def page_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """One 2-D uint8 view `(num_blocks, page_bytes)` per page-contiguous region, in layer order.

    Layer tensors with blocks outermost give one view; tensors with K and V outermost
    (`(2, num_blocks, ...)`) give two. Anything else is refused rather than copied wrongly.
    """
    views: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if t.dim() >= 2 and t.shape[0] == num_blocks:
            parts = [t]
        elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            parts = [t[0], t[1]]
        else:
            raise ValueError(
                f"kvci: unsupported KV cache layout for layer {name}: shape {tuple(t.shape)} "
                f"with {num_blocks} blocks"
            )
        for p in parts:
            if not p[0].is_contiguous():
                raise ValueError(f"kvci: pages of layer {name} are not contiguous ({p.stride()})")
            flat = p.view(p.shape[0], -1)
            views.append(flat.view(torch.uint8))
    return views


def slot_bytes(views: list[torch.Tensor]) -> int:
    """Bytes of one RAM slot: every layer's page of one block, back to back."""
    return sum(v.shape[1] for v in views)
