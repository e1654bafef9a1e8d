"""The scheduler's half of fencing KV a release of the KV cache may have outlived.

vLLM 0.33 calls the workers' ``unregister_kv_caches``/``restore_kv_caches`` around a sleep, and
0.34 also around a layer-wise weight update that borrows the (extensible) KV cache's memory. The
weights may change in between, with or without a connector reset before it
(``reset_connector=False``). The worker (``KVCIWorker.unregister_kv_caches``) fences the
generations it has seen: after the restore it refuses their loads and persists and reports
``fence_generation``. Here the scheduler resets kvci's tiers — exactly the reset vLLM's
``reset_cache`` or ``kvci reset`` does: RAM forgets, the disk tier moves every node sharing its
catalog to the next generation — unless it is past that generation already (vLLM reset the
connector before the release: nothing was computed since). The reset is applied at once, by
the same path as the control surface's (``KVCIScheduler.ask_reset``, applied before the report
is taken and before any later lookup).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvci_plugin.connector.scheduler import KVCIScheduler

logger = logging.getLogger(__name__)


def fence_after_release(scheduler: KVCIScheduler, worker_meta: Any) -> bool:
    """Ask ``scheduler`` for a reset when the workers' report says a release of the KV cache
    may have outlived its generation; whether one was asked."""
    fence = getattr(worker_meta, "fence_generation", None)
    if fence is None or scheduler.generation > fence:
        return False
    logger.warning(
        "kvci: the KV cache was released and restored (a sleep or a weight update) with no cache "
        "reset since generation %d: resetting kvci's tiers, so no KV from before is loaded",
        fence)
    scheduler.ask_reset()
    return True
