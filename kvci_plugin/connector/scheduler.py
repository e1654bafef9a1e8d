"""Scheduler side (EngineCore): keys, lookups, the worthiness decision and the job queues.

Everything here runs on vLLM's scheduler thread between steps, so per-step work stays small:
a request's prefix keys are computed once, lookups are dictionary probes, and scoring happens
once per finished request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.groups import GroupLayout, KVGroup
from kvci_plugin.connector.jobs import DiskLoadJob, FailedLoad, LoadJob, PersistJob, StoreJob
from kvci_plugin.connector.lookup_window import LookupWindow
from kvci_plugin.connector.metadata import KVCIMetadata, KVCIWorkerMetadata
from kvci_plugin.connector.retain import report_retentions, retain_ask, retain_reply
from kvci_plugin.connector.stats import KVCIStats
from kvci_plugin.ops import prefix_key_list
from kvci_plugin.policy import (
    AdmissionStats,
    ArmedCheckpoint,
    FinishedRequest,
    KeepDecider,
    KeepOutcome,
    KeepPlan,
    PolicyStateFile,
    PolicyStateSaver,
    PressureAwareAdmission,
    RAMPolicy,
    ram_policy_for,
    session_key,
)
from kvci_plugin.request.params import KVCIRequestParams, ParamsError, parse_request_params
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.health import TierUnavailableError
from kvci_plugin.tiering.keys import generation_namespace
from kvci_plugin.tiering.load_or_recompute import LoadOrRecompute
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import CheckpointOutcome, ForgetOutcome, ResetOutcome, RetainAsk
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.room import DECLARED_POOL
from kvci_plugin.tiering.types import PageKey, Reservation
from kvci_plugin.worthiness import (
    CacheGate,
    CheckpointAdvisor,
    CheckpointObservation,
    PublishedVerdict,
    PublishedVerdicts,
    RequestHistory,
    render_advisory,
    retain_advice,
)
from kvci_plugin.worthiness.cache_gate import ENGINE_WIDE_INPUTS

if TYPE_CHECKING:
    from kvci_plugin.connector.events import KVCIEvents

logger = logging.getLogger(__name__)

_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
NULL_BLOCK_ID = 0  # vLLM's BlockPool hands out block 0 as its null block (never holds KV)
_ERASED = -1  # the generation of a request whose tenant was forgotten while it ran


def _gate_reply(gate: Any, offered_prefix_tokens: int | None) -> dict[str, Any] | None:
    """The cache gate's decision as the reply shows it; a churn pause that still offered the prefix
    the session's rewrites kept says how many tokens of it."""
    if gate is None:
        return None
    reply = gate.model_dump(mode="json")
    # The hit-rate window is every tenant's lookups: a reply tells its caller none of it.
    for inputs in (reply["inputs"], *(e["inputs"] for e in reply["evaluated"])):
        for name in ENGINE_WIDE_INPUTS:
            inputs.pop(name, None)
    if offered_prefix_tokens is not None:
        reply["offered_prefix_tokens"] = offered_prefix_tokens
    return reply


def _cache_gate(config: KVCIConfig, ram: RAMPolicy) -> CacheGate:
    """The cache gate the config sets; its hit-rate floor by default is the RAM policy's."""
    g = config.cache_gate
    return CacheGate(
        kill_switch=g.kill_switch,
        hit_rate_floor=g.hit_rate_floor if g.hit_rate_floor is not None else ram.hit_rate_floor,
        hit_rate_window=g.hit_rate_window, min_lookups=g.min_lookups,
        churn_window_s=g.churn_window_s, churn_threshold=g.churn_threshold)


def _pressure_bar(config: KVCIConfig, ram: RAMPolicy, advisor: CheckpointAdvisor,
                  capacity_bytes: int) -> PressureAwareAdmission[PageKey] | None:
    """The system trigger's RAM bar, moved by the tier's pressure; None: the advisor's own."""
    if not (config.system_trigger and ram.under_bar and config.ram_admission == "pressure"):
        return None
    return PressureAwareAdmission.for_advisor(
        advisor, capacity_bytes=capacity_bytes, min_threshold=config.ram_threshold_min)


@dataclass
class _Req:
    params: KVCIRequestParams | None
    error: str | None
    tenant: str
    key_tenant: str
    keys: list[PageKey] | None  # None: this request is never matched or stored (not keyable)
    pool: str  # the fair share its keeps count against (ram_room)
    group_keys: list[list[PageKey]] | None = None  # each KV cache group's, made when first needed
    generation: int = 0  # its keys' generation: stale after a reset, _ERASED after a forget
    local_tokens: int = 0
    ext_tokens: int = 0
    hit_tier: str | None = None
    disk_sync: bool = False  # its disk hit is read in its first step (nothing else to run)
    hit_key: PageKey | None = None
    prompt_tokens: int = 0
    first_scheduled: float | None = None
    prompt_done: bool = False
    prefill_s: float | None = None
    scheduled_tokens: int = 0
    lookup_learned: bool = False  # the tier policy (and the bar) learned this request's lookup
    resident: int | None = None  # the RAM run its lookup found; the bar learns it once it runs
    disk_declined: bool = False  # counted once a request, however often vLLM asks
    retain: RetainAsk | None = None
    ends_retention: bool = False  # its session's retentions end once it is scheduled


class _ConnectorMover:
    """Queues the manager's copies as jobs for the next step's metadata."""

    def __init__(self) -> None:
        self.stores: list[StoreJob] = []
        self.persists: list[PersistJob] = []

    def store(self, reservation: Reservation, source: Any) -> bool:
        req_id, page_of = source  # page key -> (block id, KV cache group)
        pages = [page_of[key] for key, _ in reservation.new]
        self.stores.append(StoreJob(
            req_id=req_id, checkpoint_id=reservation.checkpoint_id,
            slots=[slot for _, slot in reservation.new], block_ids=[b for b, _ in pages],
            groups=[g for _, g in pages]))
        return False

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool:
        self.persists.append(PersistJob(checkpoint_id=checkpoint_id, tenant=tenant,
                                        keys=list(keys), slots=list(slots)))
        return False


class KVCIScheduler:
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
    ) -> None:
        """``layout``: the engine's KV cache groups; None: one full-attention group.
        ``events``: vLLM's KV events are on; they learn what the tiers can load.
        ``disk_attach``: the disk tier did not answer at start; attached once it does."""
        self.config = config
        self.block_size = block_size
        self.layout = layout or GroupLayout((KVGroup(()),), block_size)
        # One full-attention group: a hit is the leading run of the request's keys.
        self._plain = not self.layout.hybrid and self.layout.groups[0].full
        self._base_namespace = namespace
        self._secret = secret
        self._tp_size = tp_size
        self._tenants = tenants
        num_slots = int(config.ram_bytes) // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"kvci: ram_bytes ({int(config.ram_bytes)}) holds no page of {slot_bytes} bytes")
        state = PolicyStateFile(config.policy_state_file) if config.policy_state_file else None
        learned = state.restore() if state else None
        self.policy_restored = learned is not None  # what the policy learned before a restart
        ram = ram_policy_for(config.ram_policy)
        index = RAMIndex(num_slots, slot_bytes, config.ram_max_entries,
                         tenant_quota_bytes=config.tenant_quota_bytes,
                         policy=ram.tier_policy(learned))
        self._policy_saver = PolicyStateSaver(state, index.policy_learned) if state else None
        advisor_kwargs: dict[str, Any] = {}
        if config.ram_threshold is not None:
            advisor_kwargs["ram_threshold"] = config.ram_threshold
        if config.disk_threshold is not None:
            advisor_kwargs["disk_threshold"] = config.disk_threshold
        self._mover = _ConnectorMover()
        advisor = CheckpointAdvisor(**advisor_kwargs)
        self.manager = TieredCheckpointManager(
            index=index, mover=self._mover, advisor=advisor, disk=disk, disk_attach=disk_attach,
            disk_region=config.disk_region)
        self.events = events
        if events is not None:
            self.manager.watch(events)
        # What to keep of each finished request: the decision the simulator replays too.
        self.cache_gate = _cache_gate(config, ram)
        self._bar = _pressure_bar(config, ram, advisor, index.capacity_bytes)
        self.decider = KeepDecider(
            ram=ram, advisor=advisor, gate=self.cache_gate, sight=index.sight, bar=self._bar,
            system_trigger=config.system_trigger, auto_promote=config.auto_promote,
            durable_tier=lambda: self.manager.disk is not None, page_bytes=slot_bytes)
        self._armed = self.decider.armed  # a forget drops its tenant's (KeepDecider.disarm)
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._disk_loads: list[DiskLoadJob] = []
        self._pinned: list[list[PageKey]] = []
        self._store_of: dict[str, str] = {}  # request id -> checkpoint id of its pending store
        # Sessions by session_key(tenant, session id): one tenant's session never sees another's.
        self._history = RequestHistory()
        self._load_rule = LoadOrRecompute()
        self._stats = KVCIStats()
        # Failures contained in the hooks, counted in whichever stats are current.
        self.contain = Containment(lambda name: self._stats.count(name))
        self._failed_loads: list[FailedLoad] = []
        self._disk_healthy: bool | None = None  # last reported (a gauge, sent when it changes)
        self._stats.gauge("ram_threshold", self.ram_threshold)
        self._bar_reported = self._bar.stats() if self._bar is not None else None
        self._policy_reported = index.policy_stats()
        self._policy_changes_seen = index.policy_changes
        self._retentions_reported = self.manager.retentions.stats()
        self._retention_changes_seen = self.manager.retentions.changes
        self._verdicts = PublishedVerdicts()
        # Keys are made in the manager's generation (a disk tier's comes from its catalog).
        self.generation = self.manager.generation
        self.namespace = generation_namespace(namespace, self.generation)
        # A reset asked for from the control surface's thread, applied on the scheduler's.
        self._reset_asked: Future[ResetOutcome] | None = None
        self._window = LookupWindow(self.manager.lock)
        self._disk_suspended = False  # a reset failed to fence the disk tier

    @property
    def num_slots(self) -> int:
        return self.manager.index.num_slots

    @property
    def ram_threshold(self) -> float:
        """The RAM threshold requests are scored at now."""
        return self.decider.ram_threshold

    def admission_stats(self) -> AdmissionStats | None:
        """Control surface: the moving RAM bar's threshold and counts; None when the bar is fixed.
        Read from the control server's thread: each figure is read whole, and the snapshot may
        straddle one update of the scheduler thread's."""
        return self._bar.stats() if self._bar is not None else None

    # ---- per-request state ------------------------------------------------------------------

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        params: KVCIRequestParams | None = None
        error = retain = None
        try:
            params = parse_request_params(request.kv_transfer_params, self.config.max_params_bytes)
            retain = retain_ask(params, self.config.max_retain_s)
            tenant = self._tenants.resolve(params)
        except ParamsError as exc:
            error, tenant = str(exc), self._tenants.default
        key_tenant = self._key_tenant(tenant, request)
        keys = None
        if error is None and self._keyable(request):
            keys = self.keys_for(request.prompt_token_ids, key_tenant)
        # A verified tenant has a fair share of its own; declared ones share one (ram_room).
        verified = error is None and params is not None and params.session_token is not None
        st = _Req(params=params, error=error, tenant=tenant, key_tenant=key_tenant, keys=keys,
                  pool=tenant if verified else DECLARED_POOL,
                  generation=self.generation, prompt_tokens=request.num_prompt_tokens,
                  retain=retain,
                  ends_retention=params is not None and params.session_id is not None)
        self._reqs[request.request_id] = st
        return st

    @staticmethod
    def _key_tenant(tenant: str, request: Any) -> str:
        """LoRA adapter and cache_salt change the KV, so they are part of who may share it."""
        lora = getattr(request, "lora_request", None)
        lora_name = getattr(lora, "lora_name", "") if lora is not None else ""
        salt = getattr(request, "cache_salt", None) or ""
        return "\0".join([tenant, "lora=" + lora_name, "salt=" + salt])

    @staticmethod
    def _keyable(request: Any) -> bool:
        # Prompt-embeds requests carry placeholder token ids, and multimodal features are not
        # keyed: either would let different KV share a key.
        return (getattr(request, "prompt_embeds", None) is None
                and not getattr(request, "mm_features", None)
                and request.prompt_token_ids is not None)

    def keys_for(self, token_ids: Sequence[int], key_tenant: str) -> list[PageKey]:
        """The keys of the full blocks of ``token_ids`` (the kernel leaves a partial one out)."""
        if len(token_ids) < self.block_size:
            return []
        return prefix_key_list(token_ids, self.block_size, self.namespace, key_tenant, self._secret)

    # ---- lookups ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's lookup; a failure is a miss."""
        try:
            if self._window.open():
                self._apply_asked_reset()  # before the step's first lookup, never between two
            return self._matched_tokens(request, num_computed_tokens)
        except Exception as exc:
            self.contain.fault("lookup", exc)
            st = self._reqs.get(request.request_id)
            if st is not None:
                st.hit_tier = None
            return 0, False

    def _matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        if not st.keys or st.generation != self.generation:
            return 0, False
        bs = self.block_size
        cap = (request.num_tokens - 1) // bs  # never match every token: one must be computed
        local = num_computed_tokens // bs
        index = self.manager.index
        if self._plain:
            resident = index.longest_prefix(st.keys, st.tenant)
            ram = min(resident, cap)
        else:
            ram = resident = self.layout.longest_run(
                self._group_keys(st), local, cap, lambda ks: index.longest_prefix(ks, st.tenant))
        if st.resident is None:
            st.resident = resident  # the bar learns the first lookup, once the request runs
        disk = 0
        # The catalog is asked only when a disk hit could cover blocks that vLLM's cache and the
        # RAM tier do not: a prefix-cache hit's lookup costs no query.
        if self.manager.disk is not None and max(ram, local) < cap and not self._disk_suspended:
            disk = self._disk_lookup(st, local, cap)
            otherwise = max(ram, local)  # computed or loaded from RAM without this hit
            if disk > otherwise and not self._worth_loading(st, disk, otherwise, local):
                disk = 0
        best = max(ram, disk)
        if best <= local:
            return 0, False
        st.hit_tier = "ram" if ram >= disk else "disk"
        # A disk load on steps of its own lets other requests run while it reads; with no other
        # request to run it only adds a step (~4 ms here), so it is read before this one's forward.
        # A hybrid model's disk loads are always asynchronous: vLLM takes a failed load of one
        # only as a failed request (block-level load errors need a single KV cache group).
        st.disk_sync = (st.hit_tier == "disk" and self._reqs.keys() == {request.request_id}
                        and not self.layout.hybrid)
        return (best - local) * bs, st.hit_tier == "disk" and not st.disk_sync

    def _disk_lookup(self, st: _Req, local: int, cap: int) -> int:
        """The disk tier's run for this request; 0 while the tier is degraded or when its
        dependency fails (the tier's health then skips it until a probe finds it back)."""
        store = self.manager.disk
        assert store is not None and st.keys is not None
        try:
            return (min(store.longest_prefix(st.keys, st.tenant), cap) if self._plain else
                    self.layout.longest_run(self._group_keys(st), local, cap,
                                            lambda ks: store.longest_prefix(ks, st.tenant)))
        except TierUnavailableError:
            return 0  # degraded: skipped without asking it
        except Exception as exc:
            self.contain.fault("disk lookup", exc, tier="disk")
            return 0

    def _disk_call(self, what: str, call: Any, *args: Any) -> Any:
        """A disk-tier call the engine can do without (recency, discarding a bad page): skipped
        while the tier is degraded, its failure counted; None then."""
        try:
            return call(*args)
        except TierUnavailableError:
            return None
        except Exception as exc:
            self.contain.fault(what, exc, tier="disk")
            return None

    def _group_keys(self, st: _Req) -> list[list[PageKey]]:
        assert st.keys is not None
        if st.group_keys is None:
            st.group_keys = self.layout.group_keys(st.keys) if self.layout.hybrid else [st.keys]
        return st.group_keys

    @staticmethod
    def _pages(group_keys: list[list[PageKey]], group_block_ids: Sequence[Sequence[int]],
               first: int, last: int) -> list[tuple[PageKey, int, int]]:
        """(key, block id, group) of every page of blocks [first, last) that holds KV, block by
        block. A sliding-window group's blocks out of its window are vLLM's null block: the
        forward never reads them, and nothing is copied from or into them."""
        return [(group_keys[g][i], ids[i], g) for i in range(first, last)
                for g, ids in enumerate(group_block_ids) if ids[i] != NULL_BLOCK_ID]

    def _worth_loading(self, st: _Req, disk: int, otherwise: int, local: int) -> bool:
        """Load blocks [local, disk) from disk, or recompute those past ``otherwise``?"""
        verdict = self._load_rule.judge((disk - otherwise) * self.block_size,
                                        (disk - local) * self.manager.index.slot_bytes)
        if not verdict.load and not st.disk_declined:
            st.disk_declined = True
            self._stats.count("disk_hits_declined")
        return verdict.load

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        # After an async load vLLM calls again with 0; after a preemption the request was
        # looked up afresh and its blocks are new, so every non-zero call plans a load.
        if st is None or num_external_tokens == 0 or st.keys is None:
            return
        bs = self.block_size
        first, last = st.local_tokens // bs, (st.local_tokens + num_external_tokens) // bs
        asynchronous = st.hit_tier == "disk" and not st.disk_sync
        try:
            self._plan_load(request.request_id, st, blocks.get_block_ids(), first, last)
        except Exception as exc:
            # E.g. a forget or an eviction took the pages since the lookup: the blocks vLLM
            # allocated for them hold nothing, so they are recomputed.
            self.contain.fault("planning a load", exc, tier=st.hit_tier or "ram")
            failed = [b for ids in blocks.get_block_ids() for b in ids[first:last]
                      if b != NULL_BLOCK_ID]
            self._failed_loads.append(FailedLoad(request.request_id, failed, asynchronous))
            return
        st.ext_tokens = num_external_tokens
        st.hit_key = st.keys[last - 1]
        self._history.record_hit(st.hit_key)
        self._stats.count(f"hit_tokens_{st.hit_tier}", num_external_tokens)

    def _plan_load(self, req_id: str, st: _Req, group_block_ids: Sequence[Sequence[int]],
                   first: int, last: int) -> None:
        """Queue the load of blocks [first, last); raises with nothing queued."""
        pages = self._pages(self._group_keys(st), group_block_ids, first, last)
        keys = [key for key, _, _ in pages]
        block_ids, groups = [b for _, b, _ in pages], [g for _, _, g in pages]
        if st.hit_tier == "ram":
            slots = self.manager.index.pin(keys, st.tenant)
            self._pinned.append(keys)
            self._loads.append(LoadJob(req_id, slots, block_ids, groups))
        else:
            assert self.manager.disk is not None
            self._disk_loads.append(DiskLoadJob(req_id, st.tenant, keys, block_ids,
                                                groups, sync=st.disk_sync))
            self._disk_call("recording page use", self.manager.disk.touch, keys)

    # ---- per step -------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVCIMetadata:
        """The step's jobs; they always reach the workers (a load vLLM waits for must be run or
        reported failed), whatever fails in the bookkeeping around them."""
        try:
            self._step_bookkeeping(scheduler_output)
        except Exception as exc:
            self.contain.fault("step bookkeeping", exc)
        with self.manager.lock:  # the control surface may queue a persist from its thread
            meta = KVCIMetadata(loads=self._loads, disk_loads=self._disk_loads,
                                stores=self._mover.stores, persists=self._mover.persists,
                                failed_loads=self._failed_loads, generation=self.generation,
                                forward=scheduler_output.total_num_scheduled_tokens > 0)
            self._mover.stores, self._mover.persists = [], []
        # Every worker runs this step's loads before its forward and its stores after it, and
        # steps in order, so a slot unpinned now can only be overwritten by a later job.
        pinned, self._pinned = self._pinned, []
        self._loads, self._disk_loads, self._failed_loads = [], [], []
        try:
            for keys in pinned:
                self.manager.index.unpin(keys)
            # After this step's jobs, which were planned before it: the next step's carry the
            # new generation to the workers.
            self._apply_asked_reset()
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
            self.generation = self.manager.generation
            self.namespace = generation_namespace(self._base_namespace, self.generation)
            self._history.forget_contexts()  # keyed in the old generation

    def _step_bookkeeping(self, scheduler_output: Any) -> None:
        """What the step tells kvci: lookups to learn, prefill rates, retentions to end."""
        now = time.monotonic()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if not st.lookup_learned and st.resident is not None:
                # Once a request, though vLLM may look it up again (after a preemption), and only
                # once it runs: one aborted before it ran leaves no trace. An opted-out request
                # counts too: its hit, or its miss on a prefix the policy did not keep, is a
                # reuse of KV that others' requests built.
                st.lookup_learned = True
                if st.keys is not None and st.generation == self.generation:
                    self.manager.index.observe_lookup(st.keys)
                    if self._bar is not None:
                        self._bar.observe_lookup(st.keys, st.resident)
            if st.prompt_done and st.prefill_s is None:
                # The step after the one that completed the prompt: that forward has run.
                st.prefill_s = now - (st.first_scheduled or now)
                computed = st.prompt_tokens - st.local_tokens
                if st.ext_tokens == 0 and computed >= self.block_size:  # a recompute rate
                    self._load_rule.observe_prefill(computed, st.prefill_s)
            if st.first_scheduled is None:
                st.first_scheduled = now
            st.scheduled_tokens += n
            if st.local_tokens + st.ext_tokens + st.scheduled_tokens >= st.prompt_tokens:
                st.prompt_done = True
            if st.ends_retention:
                # Scheduled: its hit (if any) is pinned for this step's load already.
                st.ends_retention = False
                assert st.params is not None and st.params.session_id is not None
                self.manager.release_retentions(st.tenant, st.params.session_id)
        self.manager.expire_retentions()

    def update_connector_output(self, output: Any) -> None:
        """The workers' report on the step: every part is taken whatever fails in another."""
        meta = output.kv_connector_worker_meta
        report = meta if isinstance(meta, KVCIWorkerMetadata) else None
        for part in (self._apply_asked_reset, lambda: self._stores_done(output, report),
                     lambda: report is not None and self._take_report(report)):
            try:
                part()
            except Exception as exc:
                self.contain.fault("taking the workers' report", exc)

    def _stores_done(self, output: Any, report: KVCIWorkerMetadata | None) -> None:
        failed = set(report.failed_stores) if report is not None else set()
        for req_id in output.finished_sending or ():
            cid = self._store_of.pop(req_id, None)
            if cid is not None:
                # A store that failed on any rank is not loadable: its slots hold nothing.
                self._after_persist_started(self.manager.on_stored(cid, ok=req_id not in failed))

    def _take_report(self, meta: KVCIWorkerMetadata) -> None:
        for req_id in meta.failed_loads:  # recomputed: the reply reports no hit
            st = self._reqs.get(req_id)
            if st is not None and st.ext_tokens:
                self._stats.count(f"failed_hit_tokens_{st.hit_tier}", st.ext_tokens)
                st.ext_tokens, st.hit_tier = 0, None
        for nbytes, seconds in meta.disk_loads:
            self._load_rule.observe_load(nbytes, seconds)
        disk = self.manager.disk
        if meta.disk_faults and disk is not None:
            # The workers' blob store failed (not a bad blob): lookups skip the disk tier until
            # a probe finds it answering.
            disk.health.failed(RuntimeError(meta.disk_faults[0]), "a worker's blob I/O")
        if meta.bad_pages and disk is not None:
            removal = self._disk_call("discarding bad pages", disk.discard, meta.bad_pages)
            self._stats.count("disk_load_errors", len(meta.bad_pages))
            if removal is not None:
                self._stats.count("disk_checkpoints_discarded", len(removal.checkpoint_ids))
        for cid, errs in meta.persist_errors.items():
            self.manager.on_persisted(cid, ok=False, error="; ".join(errs))
            self._stats.count("persist_failures")
        for cid, n in meta.persisted.items():
            if cid not in meta.persist_errors and n >= self._tp_size:
                self._after_persist_started(self.manager.on_persisted(cid, ok=True))

    def _after_persist_started(self, outcome: Any) -> None:
        if outcome is not None and outcome.status == "persisted":
            self._stats.count("persisted_checkpoints")
        elif outcome is not None and outcome.status == "failed" and outcome.decision is not None:
            self._stats.count("persist_failures")  # permitted, and not written

    # ---- the end of a request -------------------------------------------------------------------

    def request_finished(
            self, request: Any, group_block_ids: Sequence[list[int]],
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's `request_finished_all_groups`: ``group_block_ids`` holds each KV cache
        group's blocks of the request. A failure keeps nothing new and tells the client so;
        blocks a queued store will read are still held until it has (else vLLM could hand them
        to another request before the copy)."""
        try:
            with self.manager.lock:  # atomic with a forget from the control surface's thread
                return self._finished(request, group_block_ids)
        except Exception as exc:
            self.contain.fault("deciding what to keep", exc)
            req_id = request.request_id
            self._reqs.pop(req_id, None)
            for job in self._mover.stores:
                if job.req_id == req_id:  # queued before the failure: it commits when copied
                    self._store_of.setdefault(req_id, job.checkpoint_id)
            delay = req_id in self._store_of
            params = getattr(request, "kv_transfer_params", None)
            reply = ({"kvci": {"error": "kvci failed to decide for this request (a contained "
                                        "fault; the output is unaffected)"}}
                     if isinstance(params, dict) and "kvci" in params else None)
            return delay, reply

    def _finished(self, request: Any,
                  group_block_ids: Sequence[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if (st is None or st.first_scheduled is None) and request.status.name not in _FINISHED_OK:
            # Aborted before it ran (e.g. sent while generation was paused): it built no KV and
            # used none, so it leaves no trace — no lookup, session turn, armed checkpoint
            # consumed or lesson for the bar.
            return False, None
        st = st or self._state_once(request)
        if st.generation != self.generation:
            st.keys = None  # keyed before a cache reset: its KV is neither matched nor kept
        if st.error is not None:
            self._stats.count("params_errors")
            return False, {"kvci": {"error": st.error}}
        if st.keys is not None:
            self._stats.count("lookups")
            self.decider.looked_up(st.ext_tokens > 0)
        try:
            finished = self._finished_request(request, st, group_block_ids)
        except ValueError as exc:
            self._stats.count("params_errors")
            return False, {"kvci": self._publish(st, {"error": f"invalid observation: {exc}"})}
        plan = self.decider.decide(finished)
        self._count_plan(plan)
        outcome = None
        if plan.trigger is not None and finished.prompt_keys is not None:
            outcome = self._keep(request, st, plan, group_block_ids)
        self.decider.learn(plan, None if outcome is None else KeepOutcome(
            kept=outcome.checkpoint_id is not None, evicted_pages=outcome.evicted_pages))
        delay = outcome is not None and outcome.pending
        if st.params is None:
            return delay, None  # nothing asked, nothing said: the advisory channel stays silent
        return delay, {"kvci": self._publish(st, self._reply(st, plan, outcome))}

    def _finished_request(self, request: Any, st: _Req,
                          group_block_ids: Sequence[list[int]]) -> FinishedRequest:
        """What the keep decision reads of a finished request; ValueError for a bad observation."""
        p = st.params
        client = CheckpointObservation.from_inputs(
            p.observation if p else None, p.evidence_bundle if p else None,
            p.context_bundle if p else None)
        history = None
        if st.keys is not None:
            session = (session_key(st.tenant, p.session_id)
                       if p is not None and p.session_id is not None else None)
            history = self._history.measure(session, st.keys, st.hit_key)
        # The prompt's keys when this request's KV may be kept: it is keyable and ended normally.
        prompt_keys = st.keys if request.status.name in _FINISHED_OK else None
        blocks = 0 if prompt_keys is None else min(
            request.num_computed_tokens // self.block_size, *(len(ids) for ids in group_block_ids))
        return FinishedRequest(
            tenant=st.tenant, observation=client, session_id=p.session_id if p else None,
            explicit_trigger=p.explicit_trigger if p else None, persist=bool(p and p.persist),
            opted_out=bool(p and p.opted_out), session_token=p.session_token if p else None,
            delegation_tokens=tuple(p.delegation_tokens) if p else (),
            context_tokens=request.num_prompt_tokens, output_tokens=request.num_output_tokens,
            cached_tokens=min(st.local_tokens + st.ext_tokens, request.num_prompt_tokens),
            # What rebuilding the whole prompt would take at this engine's measured prefill rate
            # (from requests that loaded nothing), not this request's own time scaled up: when
            # most of a prompt hit, that multiplies a step's fixed cost by the prompt over a few
            # tokens.
            rebuild_s=self._load_rule.recompute_s(st.prompt_tokens),
            history=history, prompt_keys=prompt_keys, blocks=blocks)

    def _count_plan(self, plan: KeepPlan) -> None:
        self._stats.count(f"recommendations_{plan.recommendation.tier.value}")
        if plan.opted_out:
            self._stats.count("store_opted_out")
        elif plan.gate is not None and not plan.gate.allow:
            self._stats.count("cache_gate_prefix_keeps" if plan.churn_keep else "cache_gate_pauses")

    def _keep(self, request: Any, st: _Req, plan: KeepPlan,
              group_block_ids: Sequence[list[int]]) -> CheckpointOutcome:
        """Carry ``plan`` out: its leading blocks into the RAM tier, a durable copy if asked."""
        prompt_keys, n_full = st.keys, plan.blocks
        assert prompt_keys is not None and plan.trigger is not None
        # Past the prompt the chain runs on into the output, keyed as the prompt was.
        chain = (prompt_keys[:n_full] if n_full <= len(prompt_keys) else
                 self.keys_for(request.all_token_ids[: n_full * self.block_size], st.key_tenant))
        group_keys = self.layout.group_keys(chain) if self.layout.hybrid else [chain]
        pages = self._pages(group_keys, group_block_ids, 0, n_full)
        keys = [key for key, _, _ in pages]
        if self.events is not None:
            self.events.describe(request, group_keys, n_full, keys)
        outcome = self.manager.checkpoint_now(
            tenant=st.tenant, keys=keys, trigger=plan.trigger, recommendation=plan.recommendation,
            source=(request.request_id, {key: (b, g) for key, b, g in pages}),
            source_ids=st.params.source_ids if st.params else (), persist=plan.persist,
            session_token=plan.session_token, delegation_tokens=plan.delegation_tokens,
            offer=plan.offer, retain=st.retain, pool=st.pool)
        self._count_outcome(outcome)
        if outcome.pending:
            self._store_of[request.request_id] = outcome.checkpoint_id
        return outcome

    def _reply(self, st: _Req, plan: KeepPlan,
               outcome: CheckpointOutcome | None) -> dict[str, Any]:
        """The `kvci` object of the response's kv_transfer_params."""
        rec = plan.recommendation
        advice = None if st.retain is not None else retain_advice(
            plan.observation, max_retain_s=self.config.max_retain_s)
        reply: dict[str, Any] = {
            "recommendation": rec.model_dump(mode="json"),
            "advisory": "\n".join(t for t in (render_advisory(rec), advice) if t),
            "retain_advice": advice,
            "retain": retain_reply(st.retain, outcome, self._stats),
            "trigger": plan.trigger,
            "tier": outcome.tier if outcome else "none",
            "checkpoint_id": outcome.checkpoint_id if outcome else None,
            "hit_tokens": st.ext_tokens,
            "hit_tier": st.hit_tier if st.ext_tokens else None,
            "cache_gate": _gate_reply(
                plan.gate, plan.blocks * self.block_size if plan.churn_keep else None),
            "persist": (outcome.persist.model_dump(mode="json")
                        if outcome and outcome.persist else None),
        }
        if outcome is not None and outcome.tier == "none":
            reply["not_kept"] = outcome.reason
        elif plan.opted_out:
            reply["not_kept"] = "the client asked for checkpoint 'never'"
        return reply

    def _publish(self, st: _Req, reply: dict[str, Any]) -> dict[str, Any]:
        """Keep the reply of a request that named its session, for the `advisory` action."""
        if st.params is not None and st.params.session_id is not None:
            # A token reaching here verified: a refused one fails the params, and nothing is published.
            self._verdicts.publish(st.tenant, st.params.session_id, reply,
                                  verified=st.params.session_token is not None)
        return reply

    def _state_once(self, request: Any) -> _Req:
        st = self._state(request)
        del self._reqs[request.request_id]
        return st

    def _count_outcome(self, outcome: Any) -> None:
        if outcome.checkpoint_id is None:
            self._stats.count("store_declined")
            return
        self._stats.count("checkpoints_ram")
        self._stats.count("evicted_checkpoints", len(outcome.evicted))
        if outcome.persist is not None:
            p = outcome.persist
            if p.status == "refused":
                check = p.decision.failed_check if p.decision is not None else "no_disk_tier"
                self._stats.count(f"gate_refusals_{check}")
            self._after_persist_started(p)

    def take_stats(self) -> KVCIStats | None:
        # Called every engine step: the policy's and the retentions' counts are read only once
        # they have moved (a decode step keeps nothing, and its stats cost it nothing).
        if self._bar is not None:
            self._report_bar(self._bar.stats())
        self._report_policy()
        if self._policy_saver is not None:
            self._policy_saver.tick()
        self._report_retentions()
        healthy = self.manager.disk_available
        if healthy is not None and healthy != self._disk_healthy:
            self._disk_healthy = healthy
            self._stats.gauge("tier_healthy_disk", 1.0 if healthy else 0.0)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVCIStats()
        return stats

    def _report_retentions(self) -> None:
        retentions = self.manager.retentions
        if retentions.changes == self._retention_changes_seen:
            return
        with self.manager.lock:
            now = retentions.stats()
            self._retention_changes_seen = retentions.changes
        report_retentions(self._retentions_reported, now, self._stats)
        self._retentions_reported = now

    def _report_policy(self) -> None:
        """The tier policy's refusals and unread evictions since the last report, as counters
        (its admissions and evictions are counted where they happen)."""
        index = self.manager.index
        changes = index.policy_changes
        if changes == self._policy_changes_seen:
            return
        self._policy_changes_seen = changes
        now = index.policy_stats()
        last = self._policy_reported
        for name, was, value in (
                ("ram_refused_under_pressure", last.refused_under_pressure, now.refused_under_pressure),
                ("ram_evicted_unread", last.evicted_before_hit, now.evicted_before_hit)):
            if value > was:
                self._stats.count(name, value - was)
        self._policy_reported = now

    def _report_bar(self, now: AdmissionStats) -> None:
        """The bar's moves since the last report, as counters and the threshold's gauge."""
        last = self._bar_reported
        assert last is not None  # set with the bar
        if now.wasted_writes > last.wasted_writes:
            self._stats.count("ram_wasted_writes", now.wasted_writes - last.wasted_writes)
        if now.missed_reuses > last.missed_reuses:
            self._stats.count("ram_missed_reuses", now.missed_reuses - last.missed_reuses)
        if now.threshold != last.threshold:
            self._stats.gauge("ram_threshold", now.threshold)
        self._bar_reported = now

    def shutdown(self) -> None:
        """The engine stops: what the policy learned is kept for the next start."""
        self.manager.close()
        if self._policy_saver is not None:
            self._policy_saver.save()

    def resolve_tenant(self, tenant: str | None, session_token: str | None) -> str:
        """Control surface: the caller's tenant (a verified session wins); ParamsError if refused."""
        return self._tenants.resolve(KVCIRequestParams(tenant=tenant, session_token=session_token))

    def forget_tenant(self, tenant: str, session_token: str | None,
                      delegation_tokens: tuple[str, ...]) -> ForgetOutcome:
        """Control surface: crypto-erase ``tenant`` once its verified credential with the forget
        scope allows it (ForgetRefusedError otherwise)."""
        self._tenants.authorize_forget(tenant, session_token, delegation_tokens)
        return self._window.run(lambda: self._forget(tenant))

    def _forget(self, tenant: str) -> ForgetOutcome:
        """Under the manager's lock, outside a lookup window: the tiers forget the tenant, and its
        requests in flight were keyed before it — they neither hit again (after a preemption)
        nor keep. Checkpoints it armed are dropped."""
        outcome = self.manager.forget(tenant)
        for st in list(self._reqs.values()):
            if st.tenant == tenant:
                st.generation = _ERASED
        for armed in [k for k in self._armed if k[0] == tenant]:
            del self._armed[armed]
        return outcome

    def arm_checkpoint(self, tenant: str, session_id: str, *, trigger: str, persist: bool,
                       session_token: str | None, delegation_tokens: tuple[str, ...]) -> None:
        """Control surface: keep the KV of this session's next finished request."""
        with self.manager.lock:
            self.decider.arm(tenant, session_id, ArmedCheckpoint(
                trigger=trigger, persist=persist, session_token=session_token,
                delegation_tokens=delegation_tokens))

    def latest_verdict(self, tenant: str, session_id: str, *, verified: bool) -> PublishedVerdict | None:
        """Control surface: what this session's latest finished request was told."""
        return self._verdicts.latest(tenant, session_id, verified=verified)

    def has_pending_work(self) -> bool:
        """Jobs queued between steps (e.g. a promote from the control surface) keep the engine
        stepping until they reach the workers."""
        return bool(self._mover.stores or self._mover.persists
                    or (self._reset_asked is not None and not self._reset_asked.done()))

    # ---- cache reset --------------------------------------------------------------------------

    def reset(self) -> ResetOutcome:
        """vLLM's `reset_cache` (the documented step after an in-place weight update): from now
        on no KV computed before this call is loaded (`TieredCheckpointManager.reset`). Runs on
        the scheduler's thread. Requests in flight were keyed in the old generation: they
        neither hit nor keep. Queued RAM copies still run (vLLM frees their blocks once they
        have), but what they copy is never loadable."""
        with self.manager.lock:
            try:
                outcome = self.manager.reset()
            except Exception:
                # RAM is empty, but the disk tier's generation could not move: its KV from
                # before stays unloadable here until a reset succeeds.
                self._disk_suspended = True
                self._stats.count("cache_reset_failures")
                raise
            self._disk_suspended = False
            self.namespace = generation_namespace(self._base_namespace, outcome.generation)
            self.generation = outcome.generation
            self._mover.persists = []
            self._pinned = []  # the index that pinned them is gone; their jobs are planned
            self._history.forget_contexts()  # the old generation's keys: no reuse, no rewrite
        self._stats.count("cache_resets")
        self._stats.count("checkpoints_fenced", outcome.ram_checkpoints + outcome.disk_checkpoints)
        logger.info("kvci: cache reset: generation %d; fenced %d RAM and %d disk checkpoints",
                    outcome.generation, outcome.ram_checkpoints, outcome.disk_checkpoints)
        return outcome

    def ask_reset(self) -> Future[ResetOutcome]:
        """Control surface (another thread): a reset, applied by the scheduler's thread at its
        next hook — before the next lookup, and after the jobs of a step already planned."""
        with self.manager.lock:
            if self._reset_asked is None or self._reset_asked.done():
                self._reset_asked = Future()
            return self._reset_asked

    def _apply_asked_reset(self) -> None:
        asked = self._reset_asked
        if asked is None or asked.done():
            return
        try:
            asked.set_result(self.reset())
        except Exception as exc:  # told to the caller that asked; the engine goes on
            logger.exception("kvci: cache reset failed")
            asked.set_exception(exc)

    def take_events(self) -> list[Any]:
        """vLLM's KV events of the tiers since the last step (none unless they are on)."""
        if self.events is None:
            return []
        self.manager.collect_expired()
        return self.events.take_events()

    def hit_tier(self, req_id: str) -> str | None:
        st = self._reqs.get(req_id)
        return st.hit_tier if st is not None else None
