"""Load planning (`update_state_after_alloc`): a hit's blocks, once vLLM allocated them, become
the step's load jobs.

A RAM hit's pages are pinned until the step's jobs reach the workers (a slot unpinned after that
can only be overwritten by a later job); a disk hit is read by the workers from its blobs. A
load that cannot be planned (a forget or an eviction took the pages since the lookup) is
reported failed, so vLLM recomputes the blocks it allocated for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.jobs import DiskLoadJob, FailedLoad, LoadJob
from kvci_plugin.connector.lookups import disk_call
from kvci_plugin.connector.request_state import (
    NULL_BLOCK_ID,
    HitTier,
    RequestState,
    RequestStates,
    pages,
)
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey
from kvci_plugin.worthiness import RequestHistory


class LoadPlans:
    """The loads planned for the next step (scheduler thread)."""

    def __init__(self, *, requests: RequestStates, manager: TieredCheckpointManager,
                 index: RAMIndex, history: RequestHistory, stats: c.Counts,
                 contain: Containment) -> None:
        self._requests = requests
        self._manager = manager
        self._index = index
        self._history = history
        self._stats = stats
        self._contain = contain
        self.loads: list[LoadJob] = []
        self.disk_loads: list[DiskLoadJob] = []
        self.failed_loads: list[FailedLoad] = []
        self._pinned: list[list[PageKey]] = []

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: plan the load of its hit."""
        st = self._requests.get(request.request_id)
        # After an async load vLLM calls again with 0; after a preemption the request was
        # looked up afresh and its blocks are new, so every non-zero call plans a load.
        if st is None or num_external_tokens == 0 or st.keys is None:
            return
        bs = self._requests.block_size
        first, last = st.local_tokens // bs, (st.local_tokens + num_external_tokens) // bs
        asynchronous = st.hit_tier is HitTier.DISK and not st.disk_sync
        try:
            self._plan(request.request_id, st, blocks.get_block_ids(), first, last)
        except Exception as exc:
            # E.g. a forget or an eviction took the pages since the lookup: the blocks vLLM
            # allocated for them hold nothing, so they are recomputed.
            self._contain.fault("planning a load", exc, tier=st.hit_tier or "ram")
            failed = [b for ids in blocks.get_block_ids() for b in ids[first:last]
                      if b != NULL_BLOCK_ID]
            self.failed_loads.append(FailedLoad(request.request_id, failed, asynchronous))
            return
        st.ext_tokens = num_external_tokens
        st.hit_key = st.keys[last - 1]
        self._history.record_hit(st.hit_key)
        self._stats.count(f"{c.HIT_TOKENS}{st.hit_tier}", num_external_tokens)

    def _plan(self, req_id: str, st: RequestState, group_block_ids: Sequence[Sequence[int]],
              first: int, last: int) -> None:
        """Queue the load of blocks [first, last); raises with nothing queued."""
        loaded = pages(self._requests.group_keys(st), group_block_ids, first, last)
        keys = [key for key, _, _ in loaded]
        block_ids, groups = [b for _, b, _ in loaded], [g for _, _, g in loaded]
        if st.hit_tier is HitTier.RAM:
            slots = self._index.pin(keys, st.tenant)
            self._pinned.append(keys)
            self.loads.append(LoadJob(req_id, slots, block_ids, groups))
        else:
            assert self._manager.has_disk_tier
            self.disk_loads.append(DiskLoadJob(req_id, st.tenant, keys, block_ids,
                                               groups, sync=st.disk_sync))
            disk_call(self._contain, "recording page use", self._manager.touch_disk, keys)

    def take(self) -> tuple[list[LoadJob], list[DiskLoadJob], list[FailedLoad]]:
        """The step's loads and failed loads; their pins end at ``unpin_taken``."""
        taken = self.loads, self.disk_loads, self.failed_loads
        self.loads, self.disk_loads, self.failed_loads = [], [], []
        return taken

    def unpin(self) -> None:
        """The step's jobs are built: every worker runs its loads before its forward and steps in
        order, so a slot unpinned now can only be overwritten by a later job."""
        pinned, self._pinned = self._pinned, []
        for keys in pinned:
            self._index.unpin(keys)

    def drop_pins(self) -> None:
        """A reset: the index that pinned them is gone; their jobs are planned."""
        self._pinned = []
