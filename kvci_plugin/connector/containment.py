"""Containment at the boundary: a kvci failure inside a hook vLLM calls never reaches vLLM.

vLLM treats an exception from a connector hook as fatal to the engine (EngineDeadError), and
kvci is an optimization: its failures may cost a miss or a recompute, nothing more. Each hook
catches what escapes kvci's own handling, falls back to "as if kvci had nothing" (a miss, a
store not kept, a load recomputed), counts the fault by tier and kind (`faults_<tier>_<kind>`,
`vllm:kvci_faults_total{tier,kind}`) and logs it once per incident: the first failure of a hook
and kind with its traceback when it is kvci's own fault, then at most one line a minute saying
how many more there were.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvci_plugin.tiering.health import TierUnavailableError, fault_kind

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
"""After the first failure of a hook and kind is logged, at most one line per this many seconds."""

TIERS = ("ram", "disk")
KINDS = ("unavailable", "timeout", "internal")


def fault_counter(tier: str, kind: str) -> str:
    """The stats counter of a fault: one of a fixed set, so /metrics' labels stay bounded."""
    return f"faults_{tier if tier in TIERS else 'ram'}_{kind if kind in KINDS else 'internal'}"


class Containment:
    """Counts and logs the failures contained in one connector role's hooks. ``count`` adds to
    the role's stats (called on the thread that saw the failure)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last logged, unlogged)

    def fault(self, hook: str, exc: BaseException, tier: str = "ram") -> str:
        """A failure contained in ``hook``; returns its kind. The caller has fallen back. A
        call skipped because its tier is degraded is no new fault (the incident is counted)."""
        if isinstance(exc, TierUnavailableError):
            return "skipped"
        kind = fault_kind(exc)
        self._count(fault_counter(tier, kind))
        now = time.monotonic()
        with self._lock:
            last, unlogged = self._logged.get((hook, kind), (None, 0))
            if last is not None and now - last < LOG_EVERY_S:
                self._logged[(hook, kind)] = (last, unlogged + 1)
                return kind
            self._logged[(hook, kind)] = (now, 0)
        more = f" ({unlogged} more since the last report)" if unlogged else ""
        if kind == "internal":  # kvci's own bug: the traceback says where
            logger.error("kvci: %s failed%s; contained (%s tier: %s): %s: %s", hook, more, tier,
                         "as a miss or a recompute", type(exc).__name__, exc, exc_info=exc)
        else:
            logger.warning("kvci: %s failed%s; contained (%s tier %s): %s: %s", hook, more, tier,
                           kind, type(exc).__name__, exc)
        return kind
