"""Loads the native extension kvci_plugin._C, which registers the torch.ops.kvci operators."""

from __future__ import annotations

import torch

try:
    import kvci_plugin._C  # noqa: F401  (importing it registers the operators)
except ImportError as error:
    raise ImportError(
        "kvci_plugin._C, the native extension, is not built: install the package "
        "(pip install .) or build it in place (python setup.py build_ext --inplace)"
    ) from error

kvci_ops = torch.ops.kvci
