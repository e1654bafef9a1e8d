"""HeldKeys: the page keys a ``KeyTable`` holds at some slots, read only when asked.

A committed checkpoint keeps its pages' slots, not key objects (``tiering.ram.pages``). When the
value policy looks for the context a checkpoint's prompt re-sent (``resent_prefix``) it probes
the prompt against its remembered anchors: made into key objects first, a prompt of hundreds of
pages cost as many allocations for every store, to find, most often, nothing. This sequence
hands a table and slots to ``KeyTable.find_last_from`` instead (probed back from the prompt's
end: what is looked for is most often a few pages back), and makes a key object only for the
positions read one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np

from kvci_plugin.ops._native import KeyTable


class HeldKeys(Sequence[bytes]):
    __slots__ = ("table", "slots")

    def __init__(self, table: KeyTable, slots: np.ndarray) -> None:
        self.table = table
        self.slots = np.ascontiguousarray(slots, np.int64)

    def __len__(self) -> int:
        return len(self.slots)

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> HeldKeys: ...

    def __getitem__(self, i: int | slice) -> bytes | HeldKeys:
        if isinstance(i, slice):
            return HeldKeys(self.table, self.slots[i])
        return self.table.keys_at(self.slots[[i]])[0]

    def keys(self) -> tuple[bytes, ...]:
        """Every key, as objects."""
        return tuple(self.table.keys_at(self.slots))
