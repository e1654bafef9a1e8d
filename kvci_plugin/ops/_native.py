"""Loads the native extension kvci_plugin._C, which registers the torch.ops.kvci operators."""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    from kvci_plugin import _C
except ImportError as error:
    raise ImportError(
        "kvci_plugin._C, the native extension, is not built: install the package "
        "(pip install .) or build it in place (python setup.py build_ext --inplace)"
    ) from error

kvci_ops = torch.ops.kvci


def pack_token_ids(token_ids: Sequence[int], out: bytearray, name: str) -> None:
    """Write ``token_ids`` into ``out`` (4 bytes each) as int32, each checked in [0, 2^31)."""
    _C.pack_token_ids(token_ids, out, name)
