"""ReuseHazard: how soon, per class, a context idle for so long is re-sent.

From "KVCache Cache in the Wild" (Wang et al., USENIX ATC '25): on real traces the probability
that a cached prefix is reused depends strongly on its workload class and on how long it has sat
idle, so an eviction that ranks by that probability beats recency. We learn it online, as a
survival model: idle age is cut into geometric buckets; for each class and bucket we count the
re-sends that happened at that idle age and the seconds contexts spent idle at that age
(exposure), both for contexts the tier holds and for those it only remembers (a tier that
learned only from what it kept could never learn that what it refuses is worth keeping). A
context still idle contributes its exposure so far at each refresh; one re-sent or forgotten
ends its idle period.

``rate(cls, age)`` is the best re-send rate (re-sends per second) that holding the context from
``age`` to some later horizon buys: the highest ratio of re-sends to exposure over the buckets
from ``age`` on. Taking the best horizon, not the next bucket alone, keeps a context whose class
comes back after a pause (a tool call, a user reading) worth holding through that pause.
A class with little evidence leans on all classes pooled: its counts are blended with the
pooled rate weighted as one context's idle time over the same buckets.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable

# Bucket edges in seconds: [0, 1), [1, 2), [2, 4) ... [2^16, inf): from one engine step to most of
# a day, each twice the last, so short pauses are told apart and long ones cost few buckets.
EDGES: tuple[float, ...] = (0.0,) + tuple(float(2**k) for k in range(17))
_BUCKETS = len(EDGES)


def bucket(age_s: float) -> int:
    return max(0, bisect.bisect_right(EDGES, age_s) - 1)


def _add_exposure(row: list[float], age_s: float) -> None:
    """Add an idle period of ``age_s`` seconds to each bucket it spent time in."""
    for j in range(_BUCKETS):
        lo = EDGES[j]
        if age_s <= lo:
            break
        hi = EDGES[j + 1] if j + 1 < _BUCKETS else age_s
        row[j] += min(age_s, hi) - lo


class ReuseHazard:
    def __init__(self) -> None:
        self._reuses: dict[Hashable, list[float]] = {}
        self._exposure: dict[Hashable, list[float]] = {}
        self._rates: dict[Hashable, list[float]] = {}
        self._pooled: list[float] = self._best([0.0] * _BUCKETS, [0.0] * _BUCKETS, None)

    def ended(self, cls: Hashable, age_s: float, *, reused: bool) -> None:
        """An idle period of a ``cls`` context ended after ``age_s`` s: re-sent, or forgotten."""
        _add_exposure(self._exposure.setdefault(cls, [0.0] * _BUCKETS), age_s)
        reuses = self._reuses.setdefault(cls, [0.0] * _BUCKETS)
        if reused:
            reuses[bucket(age_s)] += 1.0

    def refresh(self, live: Iterable[tuple[Hashable, float]]) -> None:
        """Recompute every rate, counting the idle time so far of the contexts still idle."""
        exposure = {cls: list(row) for cls, row in self._exposure.items()}
        for cls, age_s in live:
            _add_exposure(exposure.setdefault(cls, [0.0] * _BUCKETS), age_s)
        classes = set(exposure) | set(self._reuses)
        zero = [0.0] * _BUCKETS
        pooled_r = [sum(self._reuses.get(c, zero)[j] for c in classes) for j in range(_BUCKETS)]
        pooled_e = [sum(exposure.get(c, zero)[j] for c in classes) for j in range(_BUCKETS)]
        self._pooled = self._best(pooled_r, pooled_e, None)
        self._rates = {
            cls: self._best(self._reuses.get(cls, zero), exposure.get(cls, zero), (pooled_r, pooled_e))
            for cls in classes
        }

    def rate(self, cls: Hashable, age_s: float) -> float:
        return self._rates.get(cls, self._pooled)[bucket(age_s)]

    @staticmethod
    def _best(reuses: list[float], exposure: list[float],
              prior: tuple[list[float], list[float]] | None) -> list[float]:
        """Per start bucket, the best re-sends per second over the horizons from there on.

        ``prior`` is the pooled (re-sends, exposure) per bucket; None for the pooled rate itself,
        whose prior is one re-send per idle time (optimistic until evidence says otherwise, so
        a fresh tier keeps what it is offered)."""
        best = [0.0] * _BUCKETS
        for b in range(_BUCKETS):
            r = e = pr = pe = 0.0
            top = 0.0
            for k in range(b, _BUCKETS):
                r += reuses[k]
                e += exposure[k]
                # One context's idle time over the same buckets: the weight of the prior.
                width = (EDGES[k + 1] if k + 1 < _BUCKETS else 2 * EDGES[k]) - EDGES[b]
                if prior is None:
                    value = (r + 1.0) / (e + width)
                else:
                    pr += prior[0][k]
                    pe += prior[1][k]
                    value = (r + (pr + 1.0) / (pe + width) * width) / (e + width)
                top = max(top, value)
            best[b] = top
        return best
