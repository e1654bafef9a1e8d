"""Sliding-window groups: their window, copied during prefill at every boundary a hit may start
from, and kept only with the request's checkpoint (issue #47).

A sliding-window group holds only the blocks its window still reads: by the time a request
finishes, vLLM has freed (and handed out again) the window it had at the end of its prompt, so
its checkpoint alone serves no exact repeat after a decode longer than the window, and no
request sharing only part of the prompt. So, in the step whose chunk reaches a boundary B (in
blocks; `GroupLayout.boundaries`: the exact repeat's, the prompt's last full block, a ladder of
power-of-two rungs, a hybrid lookup's junction), the blocks ``needed(g, 0, B)`` of every
sliding group are copied into the RAM tier (``plan``, from ``build_connector_meta``). They are
read from vLLM's current block tables (``scheduler_output.kv_connector_block_state``): every
non-null id there is the request's until the next step's scheduling frees it, and the worker's
copy runs before any write of the next step (`PageCopyStream.hold`).

A stage is a pending RAM checkpoint of its own (``RAMIndex.reserve``, never evicting: one that
does not fit, in the tier or in ``window_stage_bytes``, is skipped and counted), committed when
every worker copied it (``reported``). A page is keyed by its block's group key whatever
boundary it was copied for, so windows of several boundaries share pages, and a window copied
for one request serves another at the same boundary. At the request's end its checkpoint takes
the staged pages still held (``windows``: reused, never copied again) and the stages go
(``finished``): a kept request's windows stay with its checkpoint, anything else's are freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.groups import GroupLayout
from kvci_plugin.connector.jobs import StoreJob
from kvci_plugin.connector.metadata import KVCIWorkerMetadata
from kvci_plugin.connector.mover import ConnectorMover
from kvci_plugin.connector.request_state import NULL_BLOCK_ID, RequestState, RequestStates
from kvci_plugin.policy import Offer
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey, RAMTierError

Page = tuple[int, int]  # (block, KV cache group)
WINDOW_ANCHOR = ("kvci", "window stage")  # the tier policy's anchor of every stage


@dataclass
class _Windows:
    """One request's boundaries and what it staged."""

    tenant: str
    boundaries: list[int]
    next: int = 0  # boundaries before it are done (staged, or missed)
    pages: dict[Page, PageKey] = field(default_factory=dict)
    stages: list[str] = field(default_factory=list)


@dataclass
class _Stage:
    req_id: str
    tenant: str
    new_pages: int  # pages it holds against window_stage_bytes
    committed: bool = False
    copied: int = 0  # ranks that reported the copy done
    drop_on_commit: bool = False  # its request ended while the copy was in flight


class WindowStages:
    """Plans, commits and ends the window stages (scheduler thread, manager's lock)."""

    def __init__(self, *, config: KVCIConfig, requests: RequestStates, index: RAMIndex,
                 mover: ConnectorMover, layout: GroupLayout, stats: c.Counts,
                 tp_size: int) -> None:
        self._config = config
        self._requests = requests
        self._index = index
        self._mover = mover
        self._layout = layout
        self._stats = stats
        self._tp_size = tp_size
        self._sliding = [g for g, group in enumerate(layout.groups) if not group.full]
        self.enabled = config.window_stages and bool(self._sliding)
        budget = config.window_stage_bytes
        budget = int(config.ram_bytes) // 8 if budget is None else int(budget)
        self._budget_pages = budget // index.slot_bytes
        self.held_pages = 0  # pages the stages hold against the budget
        self._reqs: dict[str, _Windows] = {}
        self._stages: dict[str, _Stage] = {}
        self._ids = count(1)

    # ---- which requests stage, and where ------------------------------------------------------

    def stages(self, st: RequestState) -> bool:
        """Whether ``st``'s windows may be kept: keyable, current, not opted out, and kept by
        something (the system trigger, or its own checkpoint)."""
        p = st.params
        return (self.enabled and bool(st.keys) and st.error is None
                and st.generation == self._requests.generation
                and not (p is not None and p.opted_out)
                and (self._config.system_trigger
                     or (p is not None and p.explicit_trigger is not None)))

    def begin(self, req_id: str, st: RequestState, junctions: Sequence[int] = ()) -> None:
        """At the request's first lookup: its boundaries."""
        if req_id in self._reqs or not self.stages(st):
            return
        bounds = self._layout.boundaries(st.prompt_tokens, self._config.window_ladder_from,
                                         self._config.window_interval, junctions)
        if bounds:
            self._reqs[req_id] = _Windows(st.tenant, bounds)

    # ---- each step ----------------------------------------------------------------------------

    def plan(self, scheduler_output: Any) -> None:
        """The windows this step's chunks reach, staged and queued for the workers."""
        if not self._reqs:  # no sliding-window request is being prefilled
            return
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is None:
            return
        computed = _computed_before(scheduler_output)
        bs = self._layout.block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            w = self._reqs.get(req_id)
            st = self._requests.get(req_id)
            if w is None or w.next >= len(w.boundaries) or req_id not in computed:
                continue
            if st is None or not self.stages(st):
                w.next = len(w.boundaries)  # stale or erased: nothing more
                continue
            reach = min(computed[req_id] + n, len(st.keys or ()) * bs)
            ids, pages = None, {}
            while w.next < len(w.boundaries) and w.boundaries[w.next] * bs <= reach:
                if ids is None:
                    ids = block_state.get_block_ids(req_id)
                found = self._window(self._requests.group_keys(st), ids, w.boundaries[w.next])
                w.next += 1
                if found is None:
                    self._stats.count(c.WINDOW_BOUNDARIES_MISSED)
                    continue
                pages.update((p, v) for p, v in found.items() if p not in w.pages)
            if pages:
                self._stage(req_id, st, w, pages)

    def _window(self, group_keys: list[list[PageKey]], ids: Sequence[Sequence[int]],
                boundary: int) -> dict[Page, tuple[PageKey, int]] | None:
        """Each sliding group's pages a hit of ``boundary`` blocks reads, or None if the window
        has left the tables (before this step, or inside a hit vLLM served)."""
        out: dict[Page, tuple[PageKey, int]] = {}
        for g in self._sliding:
            for i in self._layout.needed(g, 0, boundary):
                if i >= len(ids[g]) or ids[g][i] == NULL_BLOCK_ID:
                    return None
                out[(i, g)] = (group_keys[g][i], ids[g][i])
        return out

    def _stage(self, req_id: str, st: RequestState, w: _Windows,
               pages: dict[Page, tuple[PageKey, int]]) -> None:
        """Reserve the pages as a pending RAM checkpoint and queue their copy; skipped (and
        counted) when they do not fit without evicting."""
        order = sorted(pages)
        keys = [pages[p][0] for p in order]
        n_new = len(self._index.absent(keys))
        ram = self._index.stats()
        if (self.held_pages + n_new > self._budget_pages
                or ram.entries + 1 > ram.max_entries
                or ram.pages + n_new > ram.capacity_bytes // ram.slot_bytes
                or (ram.tenant_quota_bytes is not None and (ram.tenant_bytes.get(st.tenant, 0)
                    + n_new * ram.slot_bytes > ram.tenant_quota_bytes))):
            self._stats.count(c.WINDOW_STAGES_SKIPPED)
            return
        sid = f"kvci-window-{next(self._ids)}"
        try:
            # One anchor for every stage, which no lookup names: the policy never credits a hit
            # to a stage, and remembers no anchor per stage once they are gone.
            res = self._index.reserve(sid, st.tenant, keys, meta={"window_of": req_id},
                                      offer=Offer(anchor=WINDOW_ANCHOR), pool=st.pool)
        except RAMTierError:
            self._stats.count(c.WINDOW_STAGES_SKIPPED)
            return
        w.pages.update((p, pages[p][0]) for p in order)
        w.stages.append(sid)
        stage = self._stages[sid] = _Stage(req_id, st.tenant, len(res.new_keys))
        self.held_pages += stage.new_pages
        self._stats.count(c.WINDOW_STAGES)
        if not res.new_keys:
            self._committed(sid, stage)  # every page was held already: nothing to copy
            return
        where = {pages[p][0]: (pages[p][1], p[1]) for p in order}
        self._mover.window_stores.append(StoreJob(
            req_id=req_id, checkpoint_id=sid, slots=list(res.new_slots),
            block_ids=[where[k][0] for k in res.new_keys],
            groups=[where[k][1] for k in res.new_keys]))

    # ---- the workers' report ------------------------------------------------------------------

    def reported(self, report: KVCIWorkerMetadata) -> None:
        """Stages every rank copied are committed; one that failed on any rank is dropped."""
        for sid in report.window_failed:
            stage = self._stages.pop(sid, None)
            if stage is not None:
                self._release(stage)
                self._call(self._index.abort, sid)
        for sid, n in report.window_stored.items():
            stage = self._stages.get(sid)
            if stage is None:
                continue  # dropped by a forget or a reset meanwhile
            stage.copied += n
            if stage.copied >= self._tp_size:
                self._committed(sid, stage)

    def _committed(self, sid: str, stage: _Stage) -> None:
        if not self._call(self._index.commit, sid):
            self._stages.pop(sid, None)
            self._release(stage)
            return
        stage.committed = True
        if stage.drop_on_commit:
            self._drop(sid)

    # ---- the request's end --------------------------------------------------------------------

    def windows(self, req_id: str, n_blocks: int) -> set[PageKey]:
        """The staged pages of blocks before ``n_blocks`` the tier still holds: its checkpoint
        takes them as they are."""
        w = self._reqs.get(req_id)
        if w is None or not w.pages:
            return set()
        keys = [k for (i, _), k in w.pages.items() if i < n_blocks]
        return set(keys).difference(self._index.absent(keys)) if keys else set()

    def finished(self, req_id: str) -> None:
        """The request ended (kept or not): its stages go; one still copying goes at its
        commit (dropping it now would leave its pages never ready)."""
        w = self._reqs.pop(req_id, None)
        if w is None:
            return
        for sid in w.stages:
            stage = self._stages.get(sid)
            if stage is None:
                continue
            if stage.committed:
                self._drop(sid)
            else:
                stage.drop_on_commit = True

    def _drop(self, sid: str) -> None:
        stage = self._stages.pop(sid)
        self._release(stage)
        self._call(self._index.remove, sid, stage.tenant)

    def _release(self, stage: _Stage) -> None:
        self.held_pages -= stage.new_pages

    @staticmethod
    def _call(op: Any, *args: Any) -> bool:
        """An index call on a stage a forget or a reset may have dropped already."""
        try:
            op(*args)
        except RAMTierError:
            return False
        return True

    def in_flight(self) -> int:
        """Stages not yet dropped (tests, stats)."""
        return len(self._stages)


def _computed_before(scheduler_output: Any) -> dict[str, int]:
    """Each scheduled request's computed tokens before this step."""
    out = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    out.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    return out
