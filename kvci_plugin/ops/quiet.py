"""Containers the garbage collector never walks: the RAM tier's and its policies' maps by
checkpoint, page and anchor, which grow with the tier.

A container holding an object the collector tracks is tracked itself, and every full collection
walks all of it, on the scheduler thread: maps of records, of dicts or of sets by checkpoint were
tens of thousands of entries at a million-page tier, a pause that grew with the tier. What these
hold instead is ids, row numbers and page keys (atoms):

- ``untracked(container)``: a new container, untracked (``untrack_leaf``). Storing atoms in it
  never makes it tracked again (a dict is tracked anew only when an object the collector may
  track is stored in it; a list or a set never is).
- ``IdsByKey``: the ids held under each key, in the order added (the checkpoints ending at a
  slot, those anchored at a key): one ``str`` under most keys, an untracked tuple under a few.
  The dict holds only atoms, so the collector stops tracking it at its first full collection.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import TypeVar

from kvci_plugin.ops._native import untrack_leaf

T = TypeVar("T")


def untracked(container: T) -> T:
    """``container`` (new, holding no tracked object) untracked by the garbage collector: the
    caller stores only atoms in it."""
    untrack_leaf(container)
    return container


class IdsByKey:
    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[Hashable, str | tuple[str, ...]] = {}

    def __len__(self) -> int:
        """How many keys hold ids."""
        return len(self._ids)

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def get(self, key: Hashable) -> tuple[str, ...]:
        """The ids under ``key``, in the order added (none: empty)."""
        held = self._ids.get(key)
        if held is None:
            return ()
        return (held,) if isinstance(held, str) else held

    def found_in(self, keys: Iterable[Hashable]) -> Iterator[tuple[str, ...]]:
        """The ids under each of ``keys`` that holds some, in the order of ``keys``."""
        ids = self._ids
        for key in keys:
            held = ids.get(key)
            if held is not None:
                yield (held,) if isinstance(held, str) else held

    def add(self, key: Hashable, id_: str) -> None:
        """``id_`` under ``key``, after those there (an id is added under a key once)."""
        held = self._ids.get(key)
        if held is None:
            self._ids[key] = id_
        else:
            self._set(key, (held, id_) if isinstance(held, str) else (*held, id_))

    def discard(self, key: Hashable, id_: str) -> None:
        """``id_`` no longer under ``key`` (nothing when it is not)."""
        held = self._ids.get(key)
        if held is None:
            return
        if isinstance(held, str):
            if held == id_:
                del self._ids[key]
            return
        rest = tuple(i for i in held if i != id_)
        if len(rest) != len(held):
            self._set(key, rest[0] if len(rest) == 1 else rest)

    def clear(self) -> None:
        self._ids.clear()

    def _set(self, key: Hashable, ids: str | tuple[str, ...]) -> None:
        if isinstance(ids, tuple):
            untrack_leaf(ids)  # a tuple of strs: stored tracked, it made the dict tracked again
        self._ids[key] = ids
