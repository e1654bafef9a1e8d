"""Loads the native extension kvci_plugin._C, which registers the torch.ops.kvci operators."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence

import torch

from kvci_plugin.build_info import (
    REBUILD,
    describe_build,
    describe_torch,
    installed_version,
    read_build_info,
    torch_mismatch,
)


def load_error(error: ImportError) -> str:
    """Why ``kvci_plugin._C`` did not load: what it was built for and which torch is here."""
    info = read_build_info()
    present = describe_torch(installed_version("torch") or torch.__version__, torch.version.cuda)
    if info is None and importlib.util.find_spec("kvci_plugin._C") is None:
        return ("kvci_plugin._C, the native extension, is not built. Install kvci into this "
                "environment with pip install --no-build-isolation <kvci checkout or git URL>, or "
                "build it in place (python setup.py build_ext --inplace). `kvci doctor` says more.")
    built = "an unrecorded build" if info is None else describe_build(info)
    return (f"kvci_plugin._C, the native extension, failed to load: {error}. It was built for "
            f"{built}; this environment has {present}. {REBUILD[0].upper()}{REBUILD[1:]}. "
            "`kvci doctor` says more.")


try:
    from kvci_plugin import _C
except ImportError as error:
    raise ImportError(load_error(error)) from error

_mismatch = torch_mismatch(read_build_info(), installed_version("torch") or torch.__version__)
if _mismatch is not None:
    # It loaded, but torch keeps no C++ ABI between versions: it may still misbehave.
    warnings.warn(_mismatch, RuntimeWarning, stacklevel=2)

kvci_ops = torch.ops.kvci


def pack_token_ids(token_ids: Sequence[int], out: bytearray, name: str) -> None:
    """Write ``token_ids`` into ``out`` (4 bytes each) as int32, each checked in [0, 2^31)."""
    _C.pack_token_ids(token_ids, out, name)


def prefix_key_bytes(
    token_ids: Sequence[int], block_size: int, subkeys: bytes, name: str
) -> list[bytes]:
    """Each full block's 16-byte key of ``token_ids`` (checked as ``pack_token_ids`` checks
    them) under ``subkeys`` (kb || kc), in one call that makes no tensor."""
    return _C.prefix_key_bytes(token_ids, block_size, subkeys, name)


KeyTable = _C.KeyTable
"""``KeyTable(capacity)``: 16-byte page keys -> slots in ``[0, capacity)``, a prompt's keys per
call (``csrc/cpu/key_table.cpp``): ``find(keys) -> bytes`` (int64 per key, -1 when not held),
``insert(keys, slots)``, ``remove(slots)``, ``keys_at(slots)``, ``find_last_from(other, slots,
end)`` (of the keys another table holds at slots, the last this one holds, without key
objects), ``held()``, ``grow(capacity)``, ``clear()``, ``len()``; ``KeyTable.check(keys)`` and
``KeyTable.distinct(keys)`` (whether no key repeats). A key that is not 16-byte bytes raises
TypeError naming its position."""

# The RAM page table's per-page column kernels (``csrc/cpu/page_columns.cpp``, where each is
# described): one pass over a prompt's or a checkpoint's pages, on the table's numpy columns.
loadable_run = _C.loadable_run
pin_pages = _C.pin_pages
unpin_pages = _C.unpin_pages
add_pages = _C.add_pages
ref_pages = _C.ref_pages
take_pages = _C.take_pages
release_pages = _C.release_pages
held_conflict = _C.held_conflict
write_pages = _C.write_pages
written_pages = _C.written_pages

idle_cells = _C.idle_cells
"""``idle_cells(groups, since, now, n_groups, buckets) -> (count, total)``: the value policy's
open idle periods counted and their ages summed per group and age bucket in one pass
(``csrc/cpu/idle_cells.cpp``); int64 and float64 bytes, ``n_groups`` x ``buckets``."""

untrack_leaf = _C.untrack_leaf
"""``untrack_leaf(obj) -> bool``: the garbage collector stops walking ``obj`` when nothing it
refers to (but its type) is an object the collector walks, so it can be in no reference cycle
(``csrc/cpu/gc_leaf.cpp``); False, leaving it tracked, otherwise. For the tier's per-checkpoint
records, which hold only strings, numbers, bytes and numpy arrays: thousands of them walked by
every young collection were a pause that grew with the tier. Such a record must never be made to
refer to anything that can refer back to it."""

resend_probabilities = _C.resend_probabilities
"""``resend_probabilities(hazards, rows, ages, horizon, edges) -> list[float]``: the value
policy's reuse hazard for many contexts in one call (``csrc/cpu/resend.cpp``)."""


def read_files(paths: Sequence[str], out: bytearray | memoryview) -> list[int]:
    """File ``i`` into row ``i`` of ``out`` (``len(out) // len(paths)`` bytes a row), all in one
    call that releases the GIL. Per file: its size when it fitted its row and was read (the bytes
    there were, should it shrink meanwhile), else ``-errno`` (``-EFBIG``: larger than its row;
    ``-EISDIR``, ``-EINVAL``: not a regular file)."""
    return _C.read_files(paths, out)
