"""The typed Python face of the native ``torch.ops.kvci`` operators: prefix keys and page copies
(and the stream that orders page copies against the forward pass)."""

from __future__ import annotations

from kvci_plugin.ops.copy_stream import PageCopyStream, PendingCopy
from kvci_plugin.ops.pages import gather_pages, pool_slot_bytes, scatter_pages
from kvci_plugin.ops.prefix_keys import (
    KEY_FORMAT,
    MIN_SECRET_BYTES,
    derive_subkeys,
    key_bytes,
    prefix_block_keys,
    prefix_block_keys_batched,
    prefix_key_list,
)

__all__ = [
    "KEY_FORMAT",
    "MIN_SECRET_BYTES",
    "PageCopyStream",
    "PendingCopy",
    "derive_subkeys",
    "gather_pages",
    "key_bytes",
    "pool_slot_bytes",
    "prefix_block_keys",
    "prefix_block_keys_batched",
    "prefix_key_list",
    "scatter_pages",
]
