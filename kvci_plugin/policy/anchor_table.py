"""The fields of every remembered anchor that the hazard refresh reads, in columns by row.

The refresh counts the idle time so far of every context still idle: tens of thousands of
anchors at the default ghost bound. Read field by field from the anchor objects, that walk held
the engine step for tens of milliseconds at a million-page tier, and a policy-state save copied
every anchor under the index's lock. Here each anchor has a row of four numpy columns (its
score band, re-sends, what the client said of the turn's end, when it was last seen), written
as the anchor changes; the refresh and the save read the columns whole.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from kvci_plugin.policy.offer import COUNT_CAP, UNSCORED_BAND

# What a client may say of a turn's end (``Offer.pending``), numbered.
SAID: dict[bool | None, int] = {None: 0, True: 1, False: 2}
_SAID_BY_CODE = tuple(SAID)

# A class: the score's band, the re-sends (capped), what the client said of the turn's end.
PolicyClass = tuple[int, int, bool | None]


class AnchorTable:
    def __init__(self, capacity: int = 1024) -> None:
        self._band = np.zeros(capacity, np.int64)
        self._reuses = np.zeros(capacity, np.int64)
        self._said = np.zeros(capacity, np.int64)
        self._last_seen = np.zeros(capacity, np.float64)
        self._used = np.zeros(capacity, bool)
        self._free: list[int] = []
        self._next = 0  # rows below it were handed out once

    def __len__(self) -> int:
        return self._next - len(self._free)

    def add(self) -> int:
        """A row for a new anchor (``put`` its fields)."""
        if self._free:
            row = self._free.pop()
        else:
            if self._next == len(self._used):
                self._grow()
            row = self._next
            self._next += 1
        self._used[row] = True
        return row

    def put(self, row: int, band: int, reuses: int, pending: bool | None,
            last_seen: float) -> None:
        self._band[row] = band
        self._reuses[row] = reuses
        self._said[row] = SAID[pending]
        self._last_seen[row] = last_seen

    def drop(self, row: int) -> None:
        self._used[row] = False
        self._free.append(row)

    def clear(self) -> None:
        self.__init__(len(self._used))  # type: ignore[misc]

    def columns(self) -> IdleColumns:
        """The used rows' fields, copied: what ``idle_ages`` reads later, elsewhere."""
        used = self._used[: self._next]
        return IdleColumns(self._band[: self._next][used], self._reuses[: self._next][used],
                           self._said[: self._next][used], self._last_seen[: self._next][used])

    def _grow(self) -> None:
        n = 2 * len(self._used)
        for name in ("_band", "_reuses", "_said", "_last_seen", "_used"):
            old = getattr(self, name)
            new = np.zeros(n, old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


class IdleColumns:
    """Some anchors' fields (copies), and their idle ages so far per class."""

    def __init__(self, band: np.ndarray, reuses: np.ndarray, said: np.ndarray,
                 last_seen: np.ndarray) -> None:
        self.band, self.reuses, self.said, self.last_seen = band, reuses, said, last_seen

    def idle_ages(self, now: float) -> dict[Hashable, np.ndarray]:
        """Each anchor's idle age at ``now``, per class (``reuse_hazard.Live``)."""
        if not self.band.size:
            return {}
        ages = np.maximum(0.0, now - self.last_seen)
        # One small int per class: the anchors are grouped by a count of each, not a sort.
        keys = (((self.band - UNSCORED_BAND) * (COUNT_CAP + 1)
                 + np.minimum(self.reuses, COUNT_CAP)) * len(SAID) + self.said)
        return {_class_of(int(k)): ages[keys == k]
                for k in np.flatnonzero(np.bincount(keys)).tolist()}


def _class_of(key: int) -> PolicyClass:
    """The class ``idle_ages`` numbered ``key``."""
    key, said = divmod(key, len(SAID))
    band, resent = divmod(key, COUNT_CAP + 1)
    return (band + UNSCORED_BAND, resent, _SAID_BY_CODE[said])
