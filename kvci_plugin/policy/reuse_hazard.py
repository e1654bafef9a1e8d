"""ReuseHazard: how likely, per class, a context idle for so long is re-sent soon.

From "KVCache Cache in the Wild" (Wang et al., USENIX ATC '25): on real traces the probability
that a cached prefix is reused depends strongly on its workload class and on how long it has sat
idle, so an eviction that ranks by that probability beats recency. We learn it online, as a
survival model: idle age is cut into geometric buckets; for each class and bucket we count the
re-sends that happened at that idle age and the seconds contexts spent idle at that age
(exposure), both for contexts the tier holds and for those it only remembers (a tier that
learned only from what it kept could never learn that what it refuses is worth keeping). A
context still idle contributes its exposure so far at each refresh; one re-sent or forgotten
ends its idle period.

``resend_probability(cls, age, horizon)`` is how likely a context of ``cls`` idle for ``age`` is
re-sent within ``horizon`` more seconds, from the per-bucket hazards (re-sends per second of
exposure). A class with little evidence leans on all classes pooled: each bucket's counts are
blended with the pooled hazard, weighted as one context's stay in that bucket; the pooled
hazard's own prior is one re-send per stay (optimistic until evidence says otherwise, so a fresh
tier keeps what it is offered).

``live`` (in ``refresh`` and ``counts``) is the idle ages so far of the contexts still idle: an
array per class, or the anchor table's columns (``GroupedIdle``), which sum every class in one
pass. The refresh counts every remembered context, so its exposure is summed by array arithmetic
(a loop per context held the engine step for far too long at the default anchor bound), and its
per-class rates are a few array operations over classes x buckets.

``counts(live)`` is what was learned as plain counts, with the contexts still idle to be counted
as idle so far and not re-sent (censored, as a survival model counts a subject still at risk): a
tier restarted from them (``from_counts``) weighs as this one would, where a restart that kept
only the ended periods would keep every re-send and lose the idle time of all that never came
back, and would overrate every class.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from kvci_plugin.ops._native import idle_cells, resend_probabilities

# Bucket edges in seconds: [0, 1), [1, 2), [2, 4) ... [2^16, inf): from one engine step to most of
# a day, each twice the last, so short pauses are told apart and long ones cost few buckets.
EDGES: tuple[float, ...] = (0.0,) + tuple(float(2**k) for k in range(17))
_BUCKETS = len(EDGES)
# Per bucket: its start, and its span (the open last one spans whatever lies past its start).
_LOWS = np.array(EDGES)
_SPANS = np.append(np.diff(_LOWS), np.inf)
_SPANS_LIST = tuple(_SPANS.tolist())

# Idle ages so far (seconds) of the contexts still idle, per class.
Live = Mapping[Hashable, ArrayLike]


def bucket(age_s: float) -> int:
    return max(0, bisect.bisect_right(EDGES, age_s) - 1)


# A bucket's span; the open last one counts as long as all before it.
_WIDTHS = np.append(np.diff(_LOWS), _LOWS[-1])


def idle_exposure(groups: np.ndarray, since: np.ndarray, now: float,
                  n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Seconds the idle periods that began at ``since`` spent in each bucket up to ``now``,
    summed per group (``groups``: each period's group, below ``n_groups``; int64 and float64
    arrays): an ``(n_groups, buckets)`` array, and how many periods each group has.

    A period ending in bucket ``b`` spent each earlier bucket's whole span and ``age - low[b]`` in
    ``b``: per group and bucket, a count and a sum of the ages ending there, in one pass over the
    periods (``idle_cells``: O(n), no temporary as long as the table, no pass per group: the
    refresh sums tens of thousands of periods of tens of classes). Each sum adds its ages in their
    order in ``since``, so a group's row is the same, bit for bit, as the group's ages summed
    alone. A bucket's edges are powers of two: an age's binary exponent is its bucket (0 below
    1 s, the last from 2^16 s on), exactly, without a search."""
    shape = (n_groups, _BUCKETS)
    raw_count, raw_total = idle_cells(groups, since, now, n_groups, _BUCKETS)
    count = np.frombuffer(raw_count, np.int64).reshape(shape)
    total = np.frombuffer(raw_total, np.float64).reshape(shape)
    periods = count.sum(axis=1)
    past = periods[:, None] - np.cumsum(count, axis=1)  # periods that went on past a bucket
    spent = total - count * _LOWS
    spent[:, :-1] += past[:, :-1] * _SPANS[:-1]  # the open last bucket has none past it
    return spent, periods


class GroupedIdle(Protocol):
    """Open idle periods that sum their own exposure per class (``AnchorTable.idle``): a
    ``Live`` read whole, with no array of ages made per class."""

    def __len__(self) -> int:
        """How many periods are open."""

    def spent(self) -> Mapping[Hashable, np.ndarray]:
        """Per class with open periods, the seconds they spent in each bucket so far."""


def _spent(idle: Live | GroupedIdle) -> Mapping[Hashable, np.ndarray]:
    if not isinstance(idle, Mapping):
        return idle.spent()
    out = {}
    for cls, ages in idle.items():
        ages = np.asarray(ages, dtype=np.float64).ravel()
        if ages.size:
            # Periods that began -age s before 0 (0 - -age is age, exactly).
            out[cls] = idle_exposure(np.zeros(ages.size, np.int64), -ages, 0.0, 1)[0][0]
    return out


def _with_idle(
    exposure: Mapping[Hashable, Sequence[float]], idle: Live | GroupedIdle
) -> dict[Hashable, list[float]]:
    """``exposure`` (copied) with each open idle period (per class, the idle ages so far) added."""
    out = {cls: list(row) for cls, row in exposure.items()}
    for cls, spent in _spent(idle).items():
        row = out.setdefault(cls, [0.0] * _BUCKETS)
        for j, seconds in enumerate(spent.tolist()):
            row[j] += seconds
    return out


@dataclass(frozen=True, slots=True)
class HazardCounts:
    """Per class and idle-age bucket (``EDGES``): re-sends seen, and seconds of idle exposure;
    ``idle``: the periods still open (per class, the idle ages so far), counted as exposure by
    ``closed`` (apart, so that a caller holding a lock only gathers them)."""

    reuses: Mapping[Hashable, tuple[float, ...]]
    exposure: Mapping[Hashable, tuple[float, ...]]
    idle: Live | GroupedIdle = field(default_factory=dict)

    def closed(self) -> HazardCounts:
        """The same counts with every open idle period ended, not re-sent."""
        if not self.idle:
            return self
        exposure = _with_idle(self.exposure, self.idle)
        return HazardCounts(self.reuses, {key: tuple(row) for key, row in exposure.items()})


class ReuseHazard:
    def __init__(self) -> None:
        self._reuses: dict[Hashable, list[float]] = {}
        self._exposure: dict[Hashable, list[float]] = {}
        self._weigh_by([], (1.0 / _WIDTHS)[None, :])

    @classmethod
    def from_counts(cls, counts: HazardCounts) -> ReuseHazard:
        """A hazard that has learned ``counts`` (``counts()`` of another) and learns on."""
        counts = counts.closed()
        for table in (counts.reuses, counts.exposure):
            for key, row in table.items():
                if len(row) != _BUCKETS or not all(math.isfinite(v) and v >= 0.0 for v in row):
                    raise ValueError(
                        f"class {key!r}: want {_BUCKETS} finite counts >= 0, not {row!r}"
                    )
        hazard = cls()
        hazard._reuses = {key: list(row) for key, row in counts.reuses.items()}
        hazard._exposure = {key: list(row) for key, row in counts.exposure.items()}
        hazard.refresh({})
        return hazard

    def counts(self, live: Live | GroupedIdle) -> HazardCounts:
        """What was learned, with the ``live`` contexts' idle periods so far to be ended
        unreused (``HazardCounts.closed``)."""
        return HazardCounts(
            reuses={key: tuple(row) for key, row in self._reuses.items()},
            exposure={key: tuple(row) for key, row in self._exposure.items()},
            idle=live)

    def ended(self, cls: Hashable, age_s: float, *, reused: bool) -> None:
        """An idle period of a ``cls`` context ended after ``age_s`` s: re-sent, or forgotten."""
        # One period, bucket by bucket in plain floats: the same clip and sum as
        # ``idle_exposure``'s, bit for bit, without numpy's fixed cost per call (several
        # periods end at every lookup, on the scheduler thread). The clip is the span of each
        # bucket the age passed, the rest in the bucket it ends in, and 0.0 (no sum) after.
        row = self._exposure.get(cls)
        if row is None:
            row = self._exposure[cls] = [0.0] * _BUCKETS
        age = float(age_s)
        started = bisect.bisect_left(EDGES, age)  # the buckets starting before ``age``
        for j in range(started - 1):
            row[j] += _SPANS_LIST[j]
        if started:
            row[started - 1] += age - EDGES[started - 1]
        reuses = self._reuses.setdefault(cls, [0.0] * _BUCKETS)
        if reused:
            reuses[bucket(age_s)] += 1.0

    def refresh(self, live: Live | GroupedIdle) -> None:
        """Recompute every hazard, counting the idle time so far of the contexts still idle."""
        spent = _spent(live)
        # In the order the classes were first seen, never a set's: a class holds None, whose
        # hash (so a set's order, so the pooled sums' order and their last bits) is its address
        # in this process on Python 3.11.
        classes = list(dict.fromkeys([*self._exposure, *spent, *self._reuses]))
        at = {cls: i for i, cls in enumerate(classes)}
        reuses = np.zeros((len(classes), _BUCKETS))
        exposure = np.zeros((len(classes), _BUCKETS))
        for cls, row in self._reuses.items():
            reuses[at[cls]] = row
        for cls, row in self._exposure.items():
            exposure[at[cls]] = row
        for cls, seconds in spent.items():
            exposure[at[cls]] += seconds
        # All classes pooled: a running sum in the classes' order (cumsum; numpy's own sum
        # pairs its terms), so the figures do not hang on how numpy sums.
        total_reuses, total_exposure = (
            (np.cumsum(reuses, axis=0)[-1], np.cumsum(exposure, axis=0)[-1]) if classes
            else (np.zeros(_BUCKETS), np.zeros(_BUCKETS)))
        pooled = (total_reuses + 1.0) / (total_exposure + _WIDTHS)
        self._weigh_by(classes, np.vstack(
            [(reuses + pooled * _WIDTHS) / (exposure + _WIDTHS), pooled]))

    def _weigh_by(self, classes: list[Hashable], table: np.ndarray) -> None:
        """Weigh by these hazards: per class (``classes``, in order) and bucket, a row of
        ``table``, and all classes pooled its last row (``resend_probabilities`` reads it whole)."""
        self._rows = {cls: i for i, cls in enumerate(classes)}
        self._table = table

    def rates(self, cls: Hashable | None = None) -> list[float]:
        """The hazard per bucket (re-sends per second idle) of ``cls``; of all classes pooled for
        None or a class not seen."""
        return self._table[self._rows.get(cls, len(self._rows))].tolist()

    def resend_probability(self, cls: Hashable, age_s: float, horizon_s: float) -> float:
        """How likely a ``cls`` context idle for ``age_s`` is re-sent within ``horizon_s`` more."""
        return resend_probabilities(self._table, (self._rows.get(cls, len(self._rows)),),
                                    (age_s,), float(horizon_s), _LOWS)[0]

    def resend_probabilities(self, classes: Sequence[Hashable], ages_s: Sequence[float],
                             horizon_s: float) -> list[float]:
        """``resend_probability`` of each (class, idle age), in one native call (an eviction
        weighs the head of every class): per context, the hazard of its class (all classes
        pooled for a class not seen) integrated from its age to ``horizon_s`` later, bucket by
        bucket, and ``1 - exp(-that)``."""
        pooled = len(self._rows)
        return resend_probabilities(self._table, [self._rows.get(c, pooled) for c in classes],
                                    ages_s, float(horizon_s), _LOWS)
