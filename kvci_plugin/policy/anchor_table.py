"""The fields of every remembered anchor that the hazard refresh reads, in columns by row.

The refresh counts the idle time so far of every context still idle: tens of thousands of
anchors at the default ghost bound. Read field by field from the anchor objects, that walk held
the engine step for tens of milliseconds at a million-page tier, and a policy-state save copied
every anchor under the index's lock. Here each anchor has a row of numpy columns (its score
band, re-sends, what the client said of the turn's end, when it was last seen, its rebuild cost,
and its class numbered), written as the anchor changes; the refresh and the save copy two
columns whole (class and last seen) and sum every class in one pass.

Every lookup asks which of a prompt's hundreds of keys are remembered anchors: a page-key anchor's
row is also held in a native ``KeyTable``, so a prompt is probed in one call instead of a dict
probe per key (each key a new object whose hash is computed anew, in a dict of ~10^5 anchors),
and a checkpoint's held pages (``HeldKeys``) without a key object made for each. An anchor that
is not a page key (a window stage's) is never in a prompt.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvci_plugin.ops._native import KeyTable, untrack_leaf
from kvci_plugin.ops.held_keys import HeldKeys
from kvci_plugin.policy.offer import COUNT_CAP, SCORE_BANDS, UNSCORED_BAND
from kvci_plugin.policy.reuse_hazard import idle_exposure

# What a client may say of a turn's end (``Offer.pending``), numbered.
SAID: dict[bool | None, int] = {None: 0, True: 1, False: 2}
_SAID_BY_CODE = tuple(SAID)

# A class: the score's band, the re-sends (capped), what the client said of the turn's end.
PolicyClass = tuple[int, int, bool | None]
# Classes, numbered (``_class_number``); this number marks a row no anchor holds.
CLASSES = (SCORE_BANDS - UNSCORED_BAND) * (COUNT_CAP + 1) * len(SAID)


class AnchorTable:
    def __init__(self, capacity: int = 1024) -> None:
        self._band = np.zeros(capacity, np.int64)
        self._reuses = np.zeros(capacity, np.int64)
        self._said = np.zeros(capacity, np.int64)
        self._last_seen = np.zeros(capacity, np.float64)
        self._cost = np.full(capacity, np.nan)  # NaN: not known
        self._used = np.zeros(capacity, bool)
        # Each row's class, numbered, kept as the fields are put: the refresh reads it whole.
        self._class = np.full(capacity, CLASSES, np.int64)
        self._keys = KeyTable(capacity)  # page-key anchors -> their rows
        self._keyed = np.zeros(capacity, bool)  # rows held in ``_keys``
        # What the policy keeps of each row besides its fields: a held anchor's record; None for
        # a ghost, which is its row alone (tens of thousands of ghost objects were as many for
        # every full garbage collection to walk). The records are leaves the collector does not
        # track (``untrack_leaf``), so neither is the list: no full collection walks its rows.
        self._items: list[Any] = [None] * capacity
        untrack_leaf(self._items)
        self._free: list[int] = []
        self._next = 0  # rows below it were handed out once

    def __len__(self) -> int:
        return self._next - len(self._free)

    def add(self, key: Hashable) -> int:
        """A row for a new anchor ``key`` (``put`` its fields), remembered as a ghost."""
        if self._free:
            row = self._free.pop()
        else:
            if self._next == len(self._used):
                self._grow()
            row = self._next
            self._next += 1
        self._used[row] = True
        try:
            self._keys.insert((key,), np.array([row], np.int64))
        except TypeError:  # not a page key (a window stage's anchor): never in a prompt
            pass
        else:
            self._keyed[row] = True
        return row

    def hold(self, row: int, item: Any) -> None:
        """The row's anchor is held, as ``item`` (None: a ghost again)."""
        self._items[row] = item

    def held(self, row: int) -> Any:
        """The record the row's anchor is held as (``hold``)."""
        return self._items[row]

    def held_records(self) -> list[Any]:
        """Every row's record, by row (read only: an eviction weighs the records of many)."""
        return self._items

    def remembered_in(self, chain: Sequence[Hashable]) -> list[tuple[int, int, Any]]:
        """The positions of ``chain``'s keys (page keys) that are remembered anchors, each with
        its row and its held record (None: a ghost); no key object read, none hashed."""
        items = self._items
        return [(i, row, items[row]) for i, row in self._keys.find_held(chain)]

    def last_remembered(self, chain: Sequence[Hashable],
                        end: int) -> tuple[int, int, Any] | None:
        """The last of ``chain``'s first ``end`` keys that is a remembered anchor: its position,
        row and held record (None: a ghost); None when none is. Of a checkpoint's held keys
        (``HeldKeys``), probed back from ``end`` and stopped at the first found: what a store
        looks for is most often its previous turn's anchor, a few pages back."""
        if isinstance(chain, HeldKeys):
            pos, row = self._keys.find_last_from(chain.table, chain.slots, end)
            return None if pos < 0 else (pos, row, self._items[row])
        found = self.remembered_in(chain[:end])
        return found[-1] if found else None

    def put(self, row: int, band: int, reuses: int, pending: bool | None, last_seen: float,
            cost: float | None) -> None:
        said = SAID[pending]
        self._band[row] = band
        self._reuses[row] = reuses
        self._said[row] = said
        self._last_seen[row] = last_seen
        self._cost[row] = np.nan if cost is None else cost
        self._class[row] = _class_number(band, reuses, said)

    def put_seen(self, row: int, band: int, reuses: int, pending: bool | None,
                 last_seen: float) -> None:
        """The row's anchor was re-sent: its re-sends and when it was last seen, and its class
        (``put`` of a record whose band, word and cost did not change; each lookup writes this
        for every anchor in its prompt)."""
        self._reuses[row] = reuses
        self._last_seen[row] = last_seen
        self._class[row] = _class_number(band, reuses, SAID[pending])

    def put_cost(self, row: int, cost: float) -> None:
        """The row's rebuild cost per page alone (a held anchor's latest measure)."""
        self._cost[row] = cost

    def fields(self, row: int) -> tuple[int, bool | None, float, float | None, int]:
        """The row's band, what was said of its turn's end, when it was last seen, its rebuild
        cost per page (None: not known) and its re-sends, as ``put`` wrote them."""
        cost = float(self._cost[row])
        return (int(self._band[row]), _SAID_BY_CODE[int(self._said[row])],
                float(self._last_seen[row]), None if math.isnan(cost) else cost,
                int(self._reuses[row]))

    def drop(self, row: int) -> None:
        self._used[row] = False
        self._class[row] = CLASSES
        self._items[row] = None
        if self._keyed[row]:
            self._keys.remove(np.array([row], np.int64))
            self._keyed[row] = False
        self._free.append(row)

    def clear(self) -> None:
        self.__init__(len(self._used))  # type: ignore[misc]

    def idle(self, now: float) -> IdleAges:
        """Every anchor's idle age at ``now``, per class (``reuse_hazard.GroupedIdle``), from a
        copy of the columns: summed when first read (a state save reads it on its own thread)."""
        n = self._next
        return IdleAges(self._class[:n].copy(), self._last_seen[:n].copy(), now)

    def _grow(self) -> None:
        n = 2 * len(self._used)
        self._keys.grow(n)
        self._items.extend([None] * (n - len(self._items)))
        for name in ("_band", "_reuses", "_said", "_last_seen", "_cost", "_used", "_keyed",
                     "_class"):
            old = getattr(self, name)
            new = np.full(n, CLASSES if name == "_class" else 0, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


class IdleAges:
    """Idle ages so far of anchors' fields copied (``AnchorTable.idle``), summed per class when
    first read (``reuse_hazard.GroupedIdle``): a state save reads it on its own thread."""

    def __init__(self, classes: np.ndarray, last_seen: np.ndarray, now: float) -> None:
        self._columns: tuple[np.ndarray, np.ndarray] | None = (classes, last_seen)
        self._now = now
        self._periods = int(np.count_nonzero(classes != CLASSES))
        self._spent: dict[PolicyClass, np.ndarray] = {}

    def __len__(self) -> int:
        """The open idle periods: one an anchor."""
        return self._periods

    def spent(self) -> dict[PolicyClass, np.ndarray]:
        if self._columns is not None:
            classes, last_seen = self._columns
            self._columns = None
            if self._periods:
                # Every row in one pass, rows no anchor holds in a class of their own, left out.
                spent, periods = idle_exposure(classes, last_seen, self._now, CLASSES + 1)
                self._spent = {_class_of(k): spent[k]
                               for k in np.flatnonzero(periods[:CLASSES]).tolist()}
        return self._spent


def _class_number(band: int, reuses: int, said: int) -> int:
    return ((band - UNSCORED_BAND) * (COUNT_CAP + 1) + min(reuses, COUNT_CAP)) * len(SAID) + said


def _class_of(key: int) -> PolicyClass:
    """The class ``IdleAges`` numbered ``key``."""
    key, said = divmod(key, len(SAID))
    band, resent = divmod(key, COUNT_CAP + 1)
    return (band + UNSCORED_BAND, resent, _SAID_BY_CODE[said])
