"""Scheduler side (EngineCore): vLLM's scheduler hooks, each handed to the part that does it.

Everything here runs on vLLM's scheduler thread between steps, so per-step work stays small:
a request's prefix keys are computed once (`request_state`), lookups are dictionary probes
(`lookups`), loads are planned as jobs (`load_plan`), and the keep decision runs once per
finished request (`keep`). The control surface reaches the scheduler side through its own port
(`control_port`), cache resets through `cache_reset`, and the stats vLLM takes every step are
counted in `step_stats`. The parts are built by `assembly`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.assembly import assemble
from kvci_plugin.connector.async_loads import may_load_async
from kvci_plugin.connector.auto_retentions import ram_loaded
from kvci_plugin.connector.cache_reset import CacheResets
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.control_port import SchedulerControl
from kvci_plugin.connector.groups import GroupLayout, KVGroup
from kvci_plugin.connector.keep import Finish, Keeper
from kvci_plugin.connector.load_plan import LoadPlans
from kvci_plugin.connector.lookup_window import LookupWindow
from kvci_plugin.connector.lookups import Lookups
from kvci_plugin.connector.metadata import KVCIMetadata, KVCIWorkerMetadata
from kvci_plugin.connector.request_state import HitTier, RequestStates
from kvci_plugin.connector.stats import KVCIStats
from kvci_plugin.connector.step_stats import StepStats
from kvci_plugin.connector.window_stages import WindowStages
from kvci_plugin.connector.worker_report import WorkerReports
from kvci_plugin.governance import PersistenceEligibilityGate
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.request.tool_calls import ToolCallMarkers
from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.load_or_recompute import LoadOrRecompute
from kvci_plugin.tiering.outcomes import ResetOutcome
from kvci_plugin.worthiness import PublishedVerdicts, RequestHistory

if TYPE_CHECKING:
    from kvci_plugin.connector.events import KVCIEvents


class KVCIScheduler:
    """kvci's scheduler-side connector: one per engine, on vLLM's scheduler thread."""

    def __init__(
        self,
        *,
        config: KVCIConfig,
        block_size: int,
        slot_bytes: int,
        namespace: bytes,
        secret: bytes,
        tp_size: int,
        tenants: TenantResolver,
        disk: KVCheckpointStore | None,
        layout: GroupLayout | None = None,
        events: KVCIEvents | None = None,
        disk_attach: DiskAttach | None = None,
        gate: PersistenceEligibilityGate | None = None,
        markers: ToolCallMarkers | None = None,
    ) -> None:
        """``layout``: the engine's KV cache groups; None: one full-attention group.
        ``events``: vLLM's KV events are on; they learn what the tiers can load.
        ``disk_attach``: the disk tier did not answer at start; attached once it does.
        ``gate``: the persistence eligibility gate; None: the process-wide one.
        ``markers``: the model's tool-call markers; None: none (no turn is read as a tool call)."""
        self.config = config
        self.block_size = block_size
        self.layout = layout or GroupLayout((KVGroup(()),), block_size)
        parts = assemble(config, slot_bytes=slot_bytes, disk=disk, disk_attach=disk_attach,
                         events=events, gate=gate)
        self.num_slots, self._index = parts.index.num_slots, parts.index
        self.policy_restored = parts.policy_restored  # what the policy learned before a restart
        self.manager, self.decider, self.cache_gate = parts.manager, parts.decider, parts.cache_gate
        self.events = events
        self.mover, self.bar, self._policy_saver = parts.mover, parts.bar, parts.policy_saver
        # Keys are made in the manager's generation (a disk tier's comes from its catalog).
        self.requests = RequestStates(
            config=config, block_size=block_size, layout=self.layout, namespace=namespace,
            secret=secret, tenants=tenants, generation=self.manager.generation,
            erasure_epoch=lambda: self.manager.erasure_epoch)
        # Sessions by session_key(tenant, session id): one tenant's session never sees another's.
        self.history = RequestHistory()
        self.load_rule = LoadOrRecompute()
        self.stats = StepStats(manager=self.manager, index=parts.index, bar=self.bar,
                               policy_saver=parts.policy_saver, ram_threshold=self.ram_threshold)
        # Failures contained in the hooks, counted in whichever stats are current.
        self.contain = Containment(self.stats.count)
        self.resets = CacheResets(manager=self.manager, stats=self.stats,
                                  on_reset=self._reset_applied)
        self.markers = markers
        self._hook_parts(slot_bytes, tp_size, tenants)

    def _hook_parts(self, slot_bytes: int, tp_size: int, tenants: TenantResolver) -> None:
        """The parts vLLM's hooks and the control surface are handed to."""
        self._window = LookupWindow(self.manager.lock)
        # Erasures other nodes' forgets announce land outside a step's lookup window too.
        self.manager.erasures_between_lookups(self._window.run)
        self.manager.watch_faults(
            lambda exc: self.contain.fault("reading other nodes' forgets", exc, tier="disk"))
        verdicts = PublishedVerdicts()
        self.control = SchedulerControl(
            manager=self.manager, decider=self.decider, bar=self.bar, tenants=tenants,
            requests=self.requests, verdicts=verdicts, window=self._window, resets=self.resets)
        self.windows = WindowStages(
            config=self.config, requests=self.requests, index=self._index, mover=self.mover,
            layout=self.layout, stats=self.stats, tp_size=tp_size)
        self.lookups = Lookups(
            requests=self.requests, manager=self.manager, index=self._index, layout=self.layout,
            slot_bytes=slot_bytes, load_rule=self.load_rule, resets=self.resets,
            stats=self.stats, contain=self.contain, windows=self.windows)
        self.loads = LoadPlans(requests=self.requests, manager=self.manager, index=self._index,
                               history=self.history, stats=self.stats, contain=self.contain)
        self.keeper = Keeper(
            config=self.config, requests=self.requests, manager=self.manager, mover=self.mover,
            decider=self.decider, history=self.history, load_rule=self.load_rule,
            verdicts=verdicts, stats=self.stats, layout=self.layout, events=self.events,
            windows=self.windows, markers=self.markers)
        self.reports = WorkerReports(requests=self.requests, manager=self.manager,
                                     load_rule=self.load_rule, stats=self.stats,
                                     contain=self.contain, tp_size=tp_size)

    @property
    def generation(self) -> int:
        """The generation requests are keyed in now: it moves at every cache reset."""
        return self.requests.generation

    @property
    def ram_threshold(self) -> float:
        """The RAM threshold requests are scored at now."""
        return self.decider.ram_threshold

    # ---- lookups and loads ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's lookup; a failure is a miss."""
        try:
            if self._window.open():
                self.resets.apply_asked()  # before the step's first lookup, never between two
            return self.lookups.matched_tokens(request, num_computed_tokens)
        except Exception as exc:
            self.contain.fault("lookup", exc)
            st = self.requests.get(request.request_id)
            if st is not None:
                st.hit_tier = None
            return 0, False

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34's `may_load_async` (`async_loads`); a failure answers no."""
        try:
            return may_load_async(self.lookups, request)
        except Exception as exc:
            self.contain.fault("may_load_async", exc)
            return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.loads.after_alloc(request, blocks, num_external_tokens)

    def hit_tier(self, req_id: str) -> HitTier | None:
        st = self.requests.get(req_id)
        return st.hit_tier if st is not None else None

    # ---- per step -------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVCIMetadata:
        """The step's jobs; they always reach the workers (a load vLLM waits for must be run or
        reported failed), whatever fails in the bookkeeping around them."""
        try:
            self._step_bookkeeping(scheduler_output)
        except Exception as exc:
            self.contain.fault("step bookkeeping", exc)
        with self.manager.lock:  # the control surface may queue a persist from its thread
            try:
                self.windows.plan(scheduler_output)
            except Exception as exc:
                self.contain.fault("staging windows", exc)
            stores, persists = self.mover.take()
            loads, disk_loads, failed_loads = self.loads.take()
            meta = KVCIMetadata(loads=loads, disk_loads=disk_loads, stores=stores,
                                persists=persists, failed_loads=failed_loads,
                                window_stores=self.mover.take_windows(),
                                generation=self.generation,
                                forward=scheduler_output.total_num_scheduled_tokens > 0)
        try:
            self.loads.unpin()
            # After this step's jobs, which were planned before it: the next step's carry the
            # new generation to the workers.
            self.resets.apply_asked()
        except Exception as exc:
            self.contain.fault("step bookkeeping", exc)
        finally:
            self._window.close()  # the step's loads are planned: a forget asked meanwhile runs
        try:
            self._attach_disk()
        except Exception as exc:
            self.contain.fault("attaching the disk tier", exc, tier="disk")
        return meta

    def _attach_disk(self) -> None:
        """Between two steps: a disk tier that did not answer at start is attached once built;
        the next step's keys, and the workers', are in its generation."""
        if not self.manager.disk_attaching:
            return
        with self.manager.lock:
            if not self.manager.attach_disk():
                return
            self.requests.rekey(self.manager.generation)
            self.history.forget_contexts()  # keyed in the old generation

    def _step_bookkeeping(self, scheduler_output: Any) -> None:
        """What the step tells kvci: lookups to learn, prefill rates, retentions to end."""
        now = time.monotonic()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self.requests.get(req_id)
            if st is None or st.settled:
                continue
            # An opted-out request's lookup counts too: its hit, or its miss on a prefix the
            # policy did not keep, is a reuse of KV that others' requests built.
            if (st.learns_lookup() and st.keys is not None
                    and st.generation == self.generation):
                self._index.observe_lookup(st.keys)
                if self.bar is not None:
                    self.bar.observe_lookup(st.keys, st.resident)
            rate = st.scheduled(n, now, self.block_size)
            if rate is not None:
                self.load_rule.observe_prefill(*rate)
            if st.ends_retention:
                # Scheduled: its hit (if any) is pinned for this step's load already.
                st.ends_retention = False
                assert st.session_id is not None
                self.manager.release_retentions(st.tenant, st.session_id)
                self.decider.arrived(st.tenant, st.session_id)  # the pause, learned
                if hits := self.keeper.auto.returned(st.tenant, st.session_id,
                                                     ram_loaded(st, self.block_size)):
                    self.stats.count(c.RETENTIONS_AUTOMATIC_HITS, hits)
        self.manager.expire_retentions()
        if expired := self.keeper.auto.expire():
            self.stats.count(c.RETENTIONS_AUTOMATIC_EXPIRED, expired)

    def update_connector_output(self, output: Any) -> None:
        """The workers' report on the step: every part is taken whatever fails in another."""
        meta = output.kv_connector_worker_meta
        report = meta if isinstance(meta, KVCIWorkerMetadata) else None
        self._taking(self.resets.apply_asked)
        if output.finished_sending:
            self._taking(self.keeper.stores_done, output, report)
        if report is not None:  # most decode steps: the workers had nothing to say
            self._taking(self.reports.take, report)
            self._taking(self.windows.reported, report)

    def _taking(self, part: Any, *args: Any) -> None:
        """One part of taking the workers' report; a failure leaves the others to run."""
        try:
            part(*args)
        except Exception as exc:
            self.contain.fault("taking the workers' report", exc)

    def has_pending_work(self) -> bool:
        """Jobs queued between steps (e.g. a promote from the control surface) keep the engine
        stepping until they reach the workers."""
        return self.mover.pending or self.resets.pending

    def take_stats(self) -> KVCIStats | None:
        return self.stats.take()

    def take_events(self) -> list[Any]:
        """vLLM's KV events of the tiers since the last step (none unless they are on)."""
        if self.events is None:
            return []
        self.manager.collect_expired()
        return self.events.take_events()

    # ---- the end of a request -------------------------------------------------------------------

    def request_finished(self, request: Any, group_block_ids: Sequence[list[int]]) -> Finish:
        """vLLM's `request_finished_all_groups`: ``group_block_ids`` holds each KV cache group's
        blocks of the request; whether vLLM holds them for a queued copy, and the reply."""
        try:
            with self.manager.lock:  # atomic with a forget from the control surface's thread
                try:
                    return self.keeper.finished(request, group_block_ids)
                finally:  # kept or not, its windows' stages go (a kept one's pages stay)
                    self.windows.finished(request.request_id)
        except Exception as exc:
            self.contain.fault("deciding what to keep", exc)
            return self.keeper.failed(request)

    # ---- cache resets and the engine's end ------------------------------------------------------

    def reset(self) -> ResetOutcome:
        """vLLM's `reset_cache`: from now on no KV computed before this call is loaded."""
        return self.resets.reset()

    def ask_reset(self) -> Future[ResetOutcome]:
        """A reset asked from another thread (`release_fence`), applied at the next hook."""
        return self.resets.ask()

    def _reset_applied(self, outcome: ResetOutcome) -> None:
        """Under the manager's lock: the scheduler side moves to the reset's generation."""
        self.requests.rekey(outcome.generation)
        self.mover.persists = []
        self.loads.drop_pins()  # the index that pinned them is gone; their jobs are planned
        self.keeper.auto.clear()  # the retentions went with the index
        self.history.forget_contexts()  # the old generation's keys: no reuse, no rewrite

    def shutdown(self) -> None:
        """The engine stops: what the policy learned is kept for the next start."""
        self.manager.close()
        if self._policy_saver is not None:
            self._policy_saver.save()
