"""LoadOrRecompute: a disk hit is loaded only when loading it is expected to beat recomputing it.

A tier is worth using only while loading beats recomputing: SGLang HiCache's file-tier hits were
slower than recompute at 8k tokens, and on a fast GPU a short prefix prefills faster than a disk
reads it. Both rates are this engine's own measurements: the median disk-load throughput (bytes
a second, per rank) and the median prefill time per computed token, each over its last
``window`` samples. Until both are measured the hit is loaded: nothing measured says recomputing
is faster (None is "not measured", never "free"). A hit is declined only when recomputing is
expected to take less than 1/``LOAD_PREFERENCE`` of the load: a load runs on the disk and the copy
engines, while a recompute takes the compute every other request in the batch needs.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW = 64
LOAD_PREFERENCE = 2.0


@dataclass(frozen=True)
class LoadVerdict:
    load: bool
    load_s: float | None  # expected seconds to load the pages; None until loads are measured
    recompute_s: float | None  # expected seconds to prefill the tokens; None until measured


class LoadOrRecompute:
    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, not {window!r}")
        self._load_bytes_per_s: deque[float] = deque(maxlen=window)
        self._prefill_s_per_token: deque[float] = deque(maxlen=window)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A disk load of ``nbytes`` that took ``seconds`` (an empty or instant one says nothing)."""
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
        return LoadVerdict(load, load_s, recompute_s)
