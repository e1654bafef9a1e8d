"""How long a session pauses between a finished turn and its next request, learned per class.

An agent's turn that ends on a tool call comes back when the tool is done: seconds to minutes; a
turn that ends with an answer waits for a human. The engine tells the two apart by its own word
(``kvci_plugin.request.tool_calls``) or the client's ``tool_call_pending``; ``ReturnGaps``
learns each class's gaps from what it observes: a session's finished turn is remembered with
its class and time, and the session's next request closes the gap. A tool-call turn's automatic
retention lasts ``ttl``: a high quantile of its class's recent gaps, bounded by the engine's
``max_retain_s``, so that most returns find their context while a session that never comes back
holds its pages no longer than most pauses last.

Cheap per request and bounded: each class keeps its last ``window`` gaps in a sorted list
(an insertion and a removal per observed gap, a lookup per TTL), and at most ``max_sessions``
sessions' last finished turns are remembered, the least recently finished forgotten first.
Gaps are those that were observed: a session that never comes back adds none (its retention
ends at the TTL). Before a class has ``min_samples`` gaps its TTL is the prior (``prior_s``,
bounded the same way). Not thread-safe: the caller serialises calls (the manager's lock).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

TOOL_CALL = "tool_call"  # the turn ended on a tool call: the run will be back with its result
END_OF_TURN = "end_of_turn"  # the turn ended with an answer: a human speaks next
CLASSES = (TOOL_CALL, END_OF_TURN)

DEFAULT_QUANTILE = 0.6
DEFAULT_WINDOW = 512
DEFAULT_MIN_SAMPLES = 16
DEFAULT_PRIOR_S = 30.0
DEFAULT_MAX_SESSIONS = 65536


def gap_class(tool_call_pending: bool | None) -> str | None:
    """A turn's class from the word on its end (None: nothing said, nothing learned)."""
    if tool_call_pending is None:
        return None
    return TOOL_CALL if tool_call_pending else END_OF_TURN


@dataclass(frozen=True, slots=True)
class Gap:
    """One observed pause: the class of the turn before it and its length."""

    cls: str
    seconds: float


class _Window:
    """The last ``size`` gaps of one class, kept sorted as well as in arrival order."""

    __slots__ = ("order", "size", "sorted")

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: deque[float] = deque()
        self.sorted: list[float] = []

    def add(self, seconds: float) -> None:
        if len(self.order) == self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(seconds)
        bisect.insort(self.sorted, seconds)

    def quantile(self, q: float) -> float:
        """The nearest-rank ``q`` quantile (the window is not empty)."""
        rank = max(0, min(len(self.sorted) - 1, int(q * len(self.sorted) + 0.5) - 1))
        return self.sorted[rank]


class ReturnGaps:
    def __init__(self, *, quantile: float = DEFAULT_QUANTILE, window: int = DEFAULT_WINDOW,
                 min_samples: int = DEFAULT_MIN_SAMPLES, prior_s: float = DEFAULT_PRIOR_S,
                 max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
        for name, value in (("window", window), ("min_samples", min_samples),
                            ("max_sessions", max_sessions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if min_samples > window:
            raise ValueError(f"min_samples ({min_samples}) must not pass window ({window})")
        if not prior_s >= 0.0:
            raise ValueError(f"prior_s must be >= 0, got {prior_s!r}")
        self.quantile = quantile
        self.min_samples = min_samples
        self.prior_s = float(prior_s)
        self._max_sessions = max_sessions
        self._windows = {cls: _Window(window) for cls in CLASSES}
        # Per session, its last finished turn's class and time, least recently finished first.
        self._open: OrderedDict[Hashable, tuple[str, float]] = OrderedDict()

    def finished(self, session: Hashable, cls: str | None, now: float) -> None:
        """A turn of ``session`` finished at ``now`` (``cls`` None: its class is not known, and
        the pause after it teaches nothing)."""
        if cls is None:
            self._open.pop(session, None)
            return
        if cls not in self._windows:
            raise ValueError(f"unknown return-gap class {cls!r} (one of {CLASSES})")
        self._open[session] = (cls, now)
        self._open.move_to_end(session)
        while len(self._open) > self._max_sessions:
            self._open.popitem(last=False)

    def arrived(self, session: Hashable, now: float) -> Gap | None:
        """``session``'s next request arrived at ``now``: the gap it closed, learned (None:
        no finished turn of a known class was open)."""
        opened = self._open.pop(session, None)
        if opened is None:
            return None
        cls, since = opened
        gap = Gap(cls, max(0.0, now - since))
        self._windows[cls].add(gap.seconds)
        return gap

    def samples(self, cls: str) -> int:
        return len(self._windows[cls].order)

    def ttl(self, cls: str, max_s: float) -> float:
        """How long to retain a turn of ``cls``: the class's gap quantile (the prior until it
        has ``min_samples`` gaps), at most ``max_s`` (0: no retention)."""
        window = self._windows[cls]
        learned = (window.quantile(self.quantile) if len(window.order) >= self.min_samples
                   else self.prior_s)
        return max(0.0, min(learned, max_s))

    @property
    def open_sessions(self) -> int:
        return len(self._open)
