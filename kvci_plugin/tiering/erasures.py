"""Erasure epochs: which tenants were forgotten, and at which epoch, as one node knows it.

A forget begins an erasure epoch (the disk tier's catalog numbers them for every node sharing it;
without a disk tier they are this process's own). KV is stamped with the epoch known when it was
computed, and KV of a tenant stamped before that tenant's last forget is neither kept nor
recorded — no clock of any node is compared. The manager keeps the bookkeeping here and does the
erasing itself (under its lock); ``ErasureWatch`` reads other nodes' forgets off the engine's
threads.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)

ERASURE_SYNC_S = 1.0
"""How often a node sharing a disk tier reads the tenants other nodes have forgotten: the
longest their KV stays loadable from this node's RAM after the forget returned."""
MAX_ERASED_TENANTS = 65536
"""Forgotten tenants whose forget's epoch a manager keeps; older ones count as forgotten at the
latest epoch pushed out (KV computed before it is refused for every tenant: conservative)."""


class ErasureEpochs:
    """The epoch of each tenant's last forget known here, bounded (the caller holds its lock)."""

    def __init__(self, max_tenants: int = MAX_ERASED_TENANTS) -> None:
        self._max = max_tenants
        self._erased: OrderedDict[str, int] = OrderedDict()
        self._floor = 0  # a tenant pushed out counts as forgotten at this epoch
        self.local_epoch = 0  # the epochs of a node without a disk tier

    def erased_at(self, tenant: str) -> int:
        """The epoch of ``tenant``'s last forget known here: KV stamped with an older epoch
        was computed before it."""
        return self._erased.get(tenant, self._floor)

    def knows(self, tenant: str, epoch: int) -> bool:
        """Whether a forget of ``tenant`` at ``epoch`` is already known here."""
        return epoch <= self._erased.get(tenant, -1)

    def mark(self, tenant: str, epoch: int) -> None:
        """``tenant`` was forgotten at ``epoch`` (a later epoch never moves back)."""
        self._erased[tenant] = max(epoch, self._erased.get(tenant, epoch))
        self._erased.move_to_end(tenant)
        while len(self._erased) > self._max:
            _, oldest = self._erased.popitem(last=False)
            self._floor = max(self._floor, oldest)
        self.local_epoch = max(self.local_epoch, epoch)

    def lower(self, tenant: str, epoch: int) -> None:
        """A forget that failed on disk: KV of ``tenant`` computed from ``epoch`` on is kept
        again (the forget is to be asked again)."""
        self._erased[tenant] = min(self._erased.get(tenant, 0), epoch)


class ErasureWatch:
    """Calls ``sync`` every ``interval_s`` on a daemon thread of its own until stopped: a failing
    read (the catalog down) is handed to ``failed`` and tried again at the next tick."""

    def __init__(self, sync: Callable[[], object], interval_s: float,
                 failed: Callable[[BaseException], None]) -> None:
        self._sync = sync
        self._interval_s = interval_s
        self._failed = failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvci-erasures", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001 - degraded or failing: tried again later
                logger.debug("kvci: reading other nodes' forgets failed: %s", exc)
                self._failed(exc)

    def stop(self) -> None:
        self._stop.set()
