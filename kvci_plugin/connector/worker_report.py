"""The workers' report on a step (`update_connector_output`), as the scheduler side learns it.

Loads that failed are recomputed (their reply reports no hit); disk loads' sizes and times teach
the load-or-recompute rule; a failed blob store marks the disk tier degraded and bad pages are
forgotten; persists are recorded once every rank's shard is durable. The stores' completions are
the keeps' (`Keeper.stores_done`).
"""

from __future__ import annotations

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.keep import count_persist
from kvci_plugin.connector.lookups import disk_call
from kvci_plugin.connector.metadata import KVCIWorkerMetadata
from kvci_plugin.connector.request_state import RequestStates
from kvci_plugin.tiering.load_or_recompute import LoadOrRecompute
from kvci_plugin.tiering.manager import TieredCheckpointManager


class WorkerReports:
    """Takes the workers' reports (scheduler thread)."""

    def __init__(self, *, requests: RequestStates, manager: TieredCheckpointManager,
                 load_rule: LoadOrRecompute, stats: c.Counts, contain: Containment,
                 tp_size: int) -> None:
        self._requests = requests
        self._manager = manager
        self._load_rule = load_rule
        self._stats = stats
        self._contain = contain
        self._tp_size = tp_size

    def take(self, meta: KVCIWorkerMetadata) -> None:
        for req_id in meta.failed_loads:  # recomputed: the reply reports no hit
            st = self._requests.get(req_id)
            if st is not None and st.ext_tokens:
                self._stats.count(f"{c.FAILED_HIT_TOKENS}{st.hit_tier}", st.ext_tokens)
                st.ext_tokens, st.hit_tier = 0, None
        for nbytes, seconds in meta.disk_loads:
            self._load_rule.observe_load(nbytes, seconds)
        self._disk_faults(meta)
        for cid, errs in meta.persist_errors.items():
            self._manager.on_persisted(cid, ok=False, error="; ".join(errs))
            self._stats.count(c.PERSIST_FAILURES)
        for cid, n in meta.persisted.items():
            if cid not in meta.persist_errors and n >= self._tp_size:
                count_persist(self._stats, self._manager.on_persisted(cid, ok=True))

    def _disk_faults(self, meta: KVCIWorkerMetadata) -> None:
        if not self._manager.has_disk_tier:
            return
        if meta.disk_faults:
            # The workers' blob store failed (not a bad blob): lookups skip the disk tier until
            # a probe finds it answering.
            self._manager.disk_failed(RuntimeError(meta.disk_faults[0]), "a worker's blob I/O")
        if meta.bad_pages:
            removal = disk_call(self._contain, "discarding bad pages",
                                self._manager.discard_disk_pages, meta.bad_pages)
            self._stats.count(c.DISK_LOAD_ERRORS, len(meta.bad_pages))
            if removal is not None:
                self._stats.count(c.DISK_CHECKPOINTS_DISCARDED, len(removal.checkpoint_ids))
