"""LoadOrRecompute: a disk hit is loaded only when loading it is expected to beat recomputing it.

A tier is worth using only while loading beats recomputing: SGLang HiCache's file-tier hits were
slower than recompute at 8k tokens, and on a fast GPU a short prefix prefills faster than a disk
reads it. Both rates are this engine's own measurements: the median disk-load throughput (bytes
a second, per rank) and the median prefill time per computed token, each over its last
``window`` samples. Until both are measured the hit is loaded: nothing measured says recomputing
is faster (None is "not measured", never "free"). A hit is declined only when recomputing is
expected to take less than 1/``LOAD_PREFERENCE`` of the load: a load runs on the disk and the copy
engines, while a recompute takes the compute every other request in the batch needs.

A declined hit measures nothing, so slow loads (a cold cache, a dependency that was failing)
would decline every later hit forever: after ``probe_every`` declines in a row one hit is loaded
anyway, and its time joins the window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW = 64
LOAD_PREFERENCE = 2.0
DEFAULT_PROBE_EVERY = 16


@dataclass(frozen=True)
class LoadVerdict:
    load: bool
    load_s: float | None  # expected seconds to load the pages; None until loads are measured
    recompute_s: float | None  # expected seconds to prefill the tokens; None until measured


class LoadOrRecompute:
    def __init__(self, window: int = DEFAULT_WINDOW,
                 probe_every: int = DEFAULT_PROBE_EVERY) -> None:
        for name, value in (("window", window), ("probe_every", probe_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, not {value!r}")
        self._probe_every = probe_every
        self._declined = 0  # hits declined since the last one loaded
        self._load_bytes_per_s: deque[float] = deque(maxlen=window)
        self._prefill_s_per_token: deque[float] = deque(maxlen=window)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A disk load of ``nbytes`` that took ``seconds`` (empty or instant: says nothing)."""
        if nbytes > 0 and seconds > 0:
            self._load_bytes_per_s.append(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prompt whose ``tokens`` were all computed (none loaded) in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self._prefill_s_per_token.append(seconds / tokens)

    def recompute_s(self, tokens: int) -> float | None:
        """Expected seconds to prefill ``tokens``; None until a prefill is measured."""
        if not self._prefill_s_per_token:
            return None
        return tokens * statistics.median(self._prefill_s_per_token)

    def judge(self, tokens: int, nbytes: int) -> LoadVerdict:
        """Load ``nbytes`` from disk, or recompute the ``tokens`` they would save?"""
        load_s = None
        if self._load_bytes_per_s:
            load_s = nbytes / statistics.median(self._load_bytes_per_s)
        recompute_s = self.recompute_s(tokens)
        load = load_s is None or recompute_s is None or load_s <= LOAD_PREFERENCE * recompute_s
        if not load and self._declined + 1 >= self._probe_every:
            load = True  # a probe: the load rate may have recovered since it was measured
        self._declined = 0 if load else self._declined + 1
        return LoadVerdict(load, load_s, recompute_s)
