"""TieredCheckpointManager: where triggers meet the tiers and the gate, behind one face.

RAM is the default; disk is reached only through `promote` (``persists``: the persist state
machine), which re-runs the whole eligibility gate with the authority of the caller at that
moment — for every trigger, and for a checkpoint that has been resident since the session
began. Every decision is kept for `explain` (``explain``, with the tombstones of what a reset
fenced or a forget erased).

Bytes move through a `PageMover` (``mover``): inside vLLM the connector queues jobs for its
workers and calls `on_stored` / `on_persisted` when they report back; a mover that copies at
once makes both calls return at once. The logic here is the same either way. What the calls
answer is in ``outcomes``.

Which tier holds a checkpoint is read from the tiers themselves, never remembered: the disk tier
may evict or expire a record behind the manager's back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, get_args

from kvci_plugin.governance import (
    PersistenceEligibilityGate,
    Trigger,
    get_persistence_eligibility_gate,
)
from kvci_plugin.policy import Offer
from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.records import Removal
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.erasures import ErasureEpochs, ErasureWatch
from kvci_plugin.tiering.explain import (
    Tombstones,
    describe_disk,
    describe_ram,
    durable_record,
    ram_entry,
)
from kvci_plugin.tiering.forgets import TenantErasure
from kvci_plugin.tiering.health import DEPENDENCY_ERRORS, HealthReport, TierUnavailableError
from kvci_plugin.tiering.loadable import LoadablePages, TierListener
from kvci_plugin.tiering.mover import PageMover
from kvci_plugin.tiering.outcomes import (
    CheckpointOutcome,
    PromotionOutcome,
    ResetOutcome,
    RetainAsk,
)
from kvci_plugin.tiering.persists import Persists
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.retention import (
    RetentionOutcome,
    RetentionRefused,
    Retentions,
    RetentionStats,
)
from kvci_plugin.tiering.stats import tier_stats
from kvci_plugin.tiering.types import (
    CheckpointNotFoundError,
    DoesNotFitError,
    PageKey,
    Reservation,
    TenantMismatchError,
)
from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointRecommendation,
    publish_recommendation,
)

logger = logging.getLogger(__name__)

_TRIGGERS = frozenset(get_args(Trigger))


def new_checkpoint_id() -> str:
    """A fresh checkpoint id: 128 random bits in hex, as a uuid4's hex (one per store on the
    scheduler thread, without building a UUID object)."""
    return os.urandom(16).hex()


class TieredCheckpointManager(TenantErasure):
    def __init__(
        self,
        *,
        index: RAMIndex,
        mover: PageMover,
        advisor: CheckpointAdvisor | None = None,
        disk: KVCheckpointStore | None = None,
        disk_attach: DiskAttach | None = None,
        disk_region: str | None = None,
        gate: PersistenceEligibilityGate | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.mover = mover
        self.advisor = advisor or CheckpointAdvisor()
        self.disk = disk
        self._disk_attach = disk_attach  # a disk tier that did not answer at start, being built
        self._gate = gate  # None: whatever the seam holds at each evaluation
        self._clock = clock  # decides whether a disk record's retention has passed
        self.lock = threading.RLock()
        # The RAM-only generation (a disk tier keeps its own, in its catalog).
        self._generation = 0
        # The RAM checkpoints a reset fenced or a forget erased, for explain (the disk tier's
        # are in its catalog).
        self._tombstones = Tombstones()
        # Only with a listener (kv events on): which pages each tier can load.
        self._loadable: LoadablePages | None = None
        # The tenant and trigger of each store still being copied: its pages become loadable
        # when it commits, and a system checkpoint then keeps the prefix its prompt re-sent.
        self._copying: dict[str, tuple[str, Trigger]] = {}
        self.retentions = Retentions(index, index.stats().tenant_quota_bytes)
        self._persists = Persists(self, disk_region=disk_region, clock=clock)
        # Erasures: KV computed at an epoch older than its tenant's last forget is neither kept
        # nor recorded for it. Without a disk tier the epochs are this process's own.
        self._erasures = ErasureEpochs()
        # How an erasure learned from another node is applied to RAM: the scheduler passes its
        # lookup window's ``run`` (never between a step's lookup and its loads' pins).
        self._between_lookups: Callable[[Callable[[], Any]], Any] = lambda action: action()
        self._watch_failed: Callable[[BaseException], None] = lambda exc: None  # logged only
        self._watch: ErasureWatch | None = None
        self._watch_erasures()

    def watch(self, listener: TierListener) -> None:
        """Tell ``listener`` of pages as they become loadable from a tier and as they stop."""
        self._loadable = LoadablePages(listener)
        self._wire_disk()

    def _wire_disk(self) -> None:
        loadable = self._loadable
        if self.disk is not None and loadable is not None:
            self.disk.on_pages_removed = lambda keys: loadable.removed("disk", keys)

    def attach_disk(self) -> bool:
        """Between two engine steps: attach the disk tier that did not answer at start, once it
        is built; whether it was attached now (KV is keyed in its generation from now on)."""
        store = self._disk_attach.take() if self._disk_attach is not None else None
        if store is None:
            return False
        with self.lock:
            self.disk, self._disk_attach = store, None
            self._wire_disk()
            self._erasures = ErasureEpochs()  # this process's epochs; the catalog's are another
        self._watch_erasures()
        logger.warning("kvci: disk tier attached (%s), generation %d", store.describe(),
                       store.generation)
        return True

    @property
    def disk_attaching(self) -> bool:
        """Whether a disk tier that did not answer at start is still being built."""
        return self._disk_attach is not None

    @property
    def disk_available(self) -> bool | None:
        """Whether the disk tier answers now (a read of one attribute); None without one."""
        if self.disk is not None:
            return self.disk.health.available
        return False if self._disk_attach is not None else None

    @property
    def disk_health(self) -> HealthReport | None:
        """The disk tier's health (while it is being attached, that attempt's); None without one."""
        if self.disk is not None:
            return self.disk.health_report()
        return self._disk_attach.report() if self._disk_attach is not None else None

    def close(self) -> None:
        """The engine stops: a disk tier still being attached stops being tried."""
        if self._watch is not None:
            self._watch.stop()
        if self._disk_attach is not None:
            self._disk_attach.close()

    def collect_expired(self) -> None:
        """With a listener: collect the durable checkpoints whose retention has passed, so that
        their pages are told removed when they stop being loadable rather than at the next write."""
        if (self._loadable is not None and self.disk is not None
                and self._loadable.expiry_due(self._clock())):
            with self.lock:
                self.disk.gc_expired(self._clock())

    @property
    def loadable(self) -> LoadablePages | None:
        """Which pages each tier can load: kept only with a listener (``watch``)."""
        return self._loadable

    @property
    def generation(self) -> int:
        """The generation KV is keyed in now: it moves at every cache reset."""
        return self.disk.generation if self.disk is not None else self._generation

    @property
    def gate(self) -> PersistenceEligibilityGate:
        return self._gate if self._gate is not None else get_persistence_eligibility_gate()

    # ---- the connector's disk lookups and reports (scheduler thread) --------------------------

    @property
    def has_disk_tier(self) -> bool:
        """Whether a disk tier is attached, healthy or degraded."""
        return self.disk is not None

    def disk_run(self, keys: Sequence[PageKey], tenant: str) -> int:
        """The disk tier's run of ``keys`` for ``tenant`` (0 without one; raises if degraded)."""
        return self.disk.longest_prefix(keys, tenant) if self.disk is not None else 0

    def touch_disk(self, keys: Sequence[PageKey]) -> None:
        """Pages a load reads from the disk tier: their recency."""
        if self.disk is not None:
            self.disk.touch(keys)

    def discard_disk_pages(self, keys: Sequence[PageKey]) -> Removal | None:
        """Bad pages a load found: the disk checkpoints holding them are forgotten."""
        return self.disk.discard(keys) if self.disk is not None else None

    def disk_failed(self, exc: BaseException, what: str) -> None:
        """The disk tier's dependency failed elsewhere (a worker's blob I/O): it is skipped."""
        if self.disk is not None:
            self.disk.health.failed(exc, what)

    def retention_report(self, seen: int) -> tuple[int, RetentionStats] | None:
        """The retentions' change count and figures; None while unchanged since ``seen``."""
        if self.retentions.changes == seen:
            return None
        with self.lock:
            return self.retentions.changes, self.retentions.stats()

    # ---- scoring ------------------------------------------------------------------------------

    def recommend(self, observation: CheckpointObservation, *,
                  ram_threshold: float | None = None) -> CheckpointRecommendation:
        """Score a moment and publish the verdict for this task's advisory; takes no checkpoint.

        `ram_threshold` is the RAM bar to score at when the tier's bar has moved from the
        advisor's own (pressure-aware admission); None scores at the advisor's."""
        rec = self.advisor.recommend(observation, ram_threshold=ram_threshold)
        publish_recommendation(rec)
        return rec

    # ---- RAM ------------------------------------------------------------------------------------

    def checkpoint_now(
        self,
        *,
        tenant: str,
        keys: Sequence[PageKey],
        trigger: Trigger,
        recommendation: CheckpointRecommendation | None,
        source: Any,
        source_ids: Sequence[str] = (),
        persist: bool = False,
        session_token: str | None = None,
        delegation_tokens: Sequence[str] = (),
        offer: Offer | None = None,
        retain: RetainAsk | None = None,
        pool: str | None = None,
        erasure_epoch: int | None = None,
        tool_call: Mapping[str, bool | None] | None = None,
    ) -> CheckpointOutcome:
        """Keep `keys` in RAM now; `persist=True` also asks the gate for a durable copy;
        `retain` exempts the checkpoint from eviction for a while (RAM only). `pool` is the
        fair share its bytes count against (None: the tenant's own; see ``ram.room``).
        `tool_call`: whether the turn ended on a tool call (the engine's word, the one in
        force), kept for `explain` with what was retained, for how long and by whose word.

        `offer` is what the RAM tier's policy weighs (None: one anchored at the last key,
        explicit unless the trigger is the system's); the policy may find a system offer worth
        less than what it would evict, and keep nothing.

        `source` is whatever the mover copies the new pages from. Input that could only fail at
        the gate (trigger, source ids) is checked first, so a bad call keeps nothing.

        `erasure_epoch` is the epoch (``erasure_epoch``) read before the KV was computed (at the
        request's lookup); None: the epoch now. KV computed before a forget of its tenant that
        this node knows of is not kept, and its persist is never recorded on any node.
        """
        if trigger not in _TRIGGERS:
            raise ValueError(f"trigger must be one of {sorted(_TRIGGERS)}, not {trigger!r}")
        source_ids = _check_source_ids(source_ids)
        if not keys:
            return CheckpointOutcome(checkpoint_id=None, tier="none", pending=False,
                                     reason="no full block to keep")
        cid = new_checkpoint_id()
        meta = {
            "trigger": trigger,
            # Its JSON, one string: serialised in one call, packed and kept as one object.
            "recommendation": recommendation.model_dump_json() if recommendation else None,
            "source_ids": list(source_ids),
            "refusal": None,
            "decision": None,
            "persist_error": None,
            "tool_call": dict(tool_call) if tool_call is not None else None,
            "retention": None,
        }
        with self.lock:
            stamp = self.erasure_epoch if erasure_epoch is None else erasure_epoch
            if stamp < self.erased_at(tenant):
                return CheckpointOutcome(
                    checkpoint_id=None, tier="none", pending=False,
                    reason="not kept: its KV was computed before its tenant was forgotten")
            meta["erasure_epoch"] = stamp
            retained = self._retention_refused(tenant, keys, retain, pool)
            try:
                # Without an offer, what the trigger says: only the system's own keeps are weighed.
                res = self.index.reserve(
                    cid, tenant, keys, meta,
                    offer=offer or Offer(anchor=keys[-1], explicit=trigger != "system"),
                    pool=pool)
            except (DoesNotFitError, TenantMismatchError) as exc:
                return CheckpointOutcome(checkpoint_id=None, tier="none", pending=False,
                                         reason=f"not kept in RAM: {exc}", retain=retained)
            evicted_pages = tuple(chain.from_iterable(e.freed for e in res.evicted))
            if self._loadable is not None:
                self._loadable.removed("ram", evicted_pages)
            if retained is None and retain is not None:
                retained = self.retentions.grant(
                    cid, tenant, keys, retain.ttl_s, retain.session, pool)
            if retained is not None and retain is not None:
                self.index.set_meta(cid, retention=retain.describe(retained))
            done = self._store(res, source, tenant, trigger)
            persist_outcome = None
            if persist:
                persist_outcome = self.promote(
                    cid, tenant=tenant, trigger=trigger, session_token=session_token,
                    delegation_tokens=delegation_tokens)
        return CheckpointOutcome(
            checkpoint_id=cid, tier="ram", pending=not done, reason="kept in RAM",
            new_pages=len(res.new_keys), reused_pages=res.reused_pages,
            evicted=tuple(e.checkpoint_id for e in res.evicted if not e.trimmed),
            trimmed=tuple(e.checkpoint_id for e in res.evicted if e.trimmed),
            evicted_pages=evicted_pages,
            persist=persist_outcome, retain=retained)

    def _retention_refused(self, tenant: str, keys: Sequence[PageKey], retain: RetainAsk | None,
                           pool: str | None) -> RetentionOutcome | None:
        """(Lock held.) A retention asked that would be refused: told whether or not the KV is
        kept."""
        if retain is None:
            return None
        try:
            self.retentions.check(tenant, keys, pool)
        except RetentionRefused as exc:
            return RetentionOutcome(status="refused", ttl_s=retain.ttl_s, reason=str(exc))
        return None

    def _store(self, res: Reservation, source: Any, tenant: str, trigger: Trigger) -> bool:
        """(Lock held.) Copy the reservation's new pages in; whether it is committed already
        (False: the mover reports it later, ``on_stored``)."""
        cid = res.checkpoint_id
        done = True
        if res.new_keys:
            try:
                done = self.mover.store(res, source)
            except BaseException:
                # Never leave a reservation that nothing will commit: its slots would leak.
                self.index.abort(cid)
                self.retentions.dropped(cid)
                raise
        if done:
            self._commit(cid)
            self._keep_resent_prefix(cid, trigger)
            if res.new_keys:
                self._persists.start_ready()
        else:
            self._copying[cid] = (tenant, trigger)
        return done

    def expire_retentions(self) -> None:
        """End the retentions whose TTL has passed: their checkpoints compete again."""
        with self.lock:
            self.retentions.expire()

    def release_retentions(self, tenant: str, session: str) -> None:
        """The session's next request arrived: its retentions end."""
        with self.lock:
            self.retentions.release_session(tenant, session)

    def on_stored(self, checkpoint_id: str, ok: bool) -> PromotionOutcome | None:
        """A queued RAM copy finished (or failed); starts the persists it was holding up.

        Returns the outcome of this checkpoint's own persist when one started now.
        """
        with self.lock:
            tenant, trigger = self._copying.pop(checkpoint_id, (None, None))
            if checkpoint_id in self._tombstones:
                return None  # a copy of KV from before a reset or a forget: never loadable
            if ok:
                self._commit(checkpoint_id)
                if tenant is not None:
                    self._keep_resent_prefix(checkpoint_id, trigger)
            else:
                keys = self.index.get(checkpoint_id, tenant).keys if tenant is not None else ()
                self.index.abort(checkpoint_id)
                self.retentions.dropped(checkpoint_id)
                if self._loadable is not None:
                    self._loadable.removed("ram", self.index.absent(keys))
                self._persists.drop(checkpoint_id)
            return self._persists.start_ready().get(checkpoint_id)

    # ---- disk -----------------------------------------------------------------------------------

    def promote(
        self,
        checkpoint_id: str,
        *,
        tenant: str,
        trigger: Trigger,
        session_token: str | None,
        delegation_tokens: Sequence[str] = (),
    ) -> PromotionOutcome:
        """RAM -> disk through the gate, with authority derived now from these credentials.

        Another tenant's checkpoint raises `TenantMismatchError`, an unknown one
        `CheckpointNotFoundError`. A checkpoint that is already durable, or whose permitted
        write is under way, is not written again (``persists``).
        """
        with self.lock:
            return self._persists.promote(
                checkpoint_id,
                tenant=tenant,
                trigger=trigger,
                session_token=session_token,
                delegation_tokens=delegation_tokens,
            )

    def on_persisted(self, checkpoint_id: str, ok: bool, error: str = "") -> PromotionOutcome:
        """Every shard's blobs are durable (or one failed): record the catalog row, or the error.

        A report for a checkpoint with no write under way (a duplicate report) changes nothing.
        """
        with self.lock:
            return self._persists.on_persisted(checkpoint_id, ok, error)

    # ---- lifecycle ------------------------------------------------------------------------------

    def reset(self) -> ResetOutcome:
        """A cache reset (after an in-place weight update): no KV computed before it is ever
        loaded after it. RAM forgets every checkpoint, copies in flight included (their reports
        are ignored); the persists not yet recorded never are; the disk tier fences its
        generation for every node sharing its catalog. Keys move to the next generation."""
        with self.lock:
            now = self._clock()
            ram = self.index.clear()
            self.retentions.clear()
            self._copying.clear()
            if self._loadable is not None:
                self._loadable.cleared("ram")
            self._persists.fence_all()
            generation, durable = self.generation + 1, ()
            try:
                if self.disk is not None:
                    fence = self.disk.reset()
                    generation, durable = fence.generation, fence.checkpoint_ids
                    if self._loadable is not None:  # the fenced pages of other nodes too
                        self._loadable.cleared("disk")
                else:
                    self._generation = generation
            finally:  # RAM is empty even when the disk tier failed: explain says why
                self._tombstones.fence(ram, now, generation)
            return ResetOutcome(
                generation=generation, ram_checkpoints=len(ram), disk_checkpoints=len(durable)
            )

    # ---- inspection -----------------------------------------------------------------------------

    def explain(self, checkpoint_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Why this checkpoint exists and why it is where it is (tenant-checked when given).

        Another tenant's checkpoint raises `TenantMismatchError` on either tier.
        """
        out: dict[str, Any] = {"checkpoint_id": checkpoint_id, "gate_in_force": self.gate.name}
        with self.lock:
            # Without a tenant (operator tools), a lookup by id: no walk of the index.
            entry = (self.index.find(checkpoint_id) if tenant is None
                     else ram_entry(self.index, checkpoint_id, tenant))
            try:
                record = durable_record(self.disk, checkpoint_id, tenant, self._clock())
            except (TierUnavailableError, *DEPENDENCY_ERRORS):
                if entry is None:
                    raise  # only the disk tier could say: the caller is told it is unavailable
                record = None  # RAM holds it; whether disk does too cannot be said now
            if entry is not None:
                return {**out, **describe_ram(entry, record, self._persists.state(checkpoint_id))}
        if record is None:
            self._tombstones.raise_if_gone(checkpoint_id, tenant, self.disk)
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held")
        return {**out, **describe_disk(record)}

    def ram_stats(self) -> dict[str, Any]:
        """Occupancy, the gate in force and the registered scorers (a score means nothing
        without knowing what produced it); ``stats.tier_stats``."""
        s = self.index.stats()
        with self.lock:
            persists = len(self._persists)
            r = self.retentions.stats()
        return tier_stats(s, persists, r, gate=self.gate.name, scorers={
            e.name: e.weight for e in self.advisor.registry.entries()},
            disk=self.disk, disk_attach=self._disk_attach)

    # ---- helpers (caller holds the lock) --------------------------------------------------------

    def _commit(self, checkpoint_id: str) -> None:
        """(Lock held.) A RAM copy is in: the checkpoint is committed, and the pages it copied
        in are told loadable (a page it shares was told by the store that copied it in: the
        work is the new pages', not the whole prompt's)."""
        ready = self.index.commit(checkpoint_id, ready_keys=self._loadable is not None)
        self.retentions.committed()
        if ready and self._loadable is not None:
            self._loadable.stored("ram", ready)

    def _keep_resent_prefix(self, checkpoint_id: str, trigger: Trigger | None) -> None:
        """A checkpoint the system kept committed: the prefix its prompt re-sent keeps a value of
        its own (``RAMIndex.keep_resent_prefix``). An explicit one needs none: it leaves last."""
        if trigger == "system":
            self.index.keep_resent_prefix(checkpoint_id, new_checkpoint_id())


def _check_source_ids(source_ids: Iterable[str]) -> tuple[str, ...]:
    if isinstance(source_ids, (str, bytes)):
        raise TypeError("source_ids must be a sequence of source ids, not a single str/bytes")
    ids = tuple(source_ids)
    for i, source_id in enumerate(ids):
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"source_ids[{i}] must be a non-empty string, not {source_id!r}")
    return ids
