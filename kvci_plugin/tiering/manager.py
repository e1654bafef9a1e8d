"""TieredCheckpointManager: the seed's one place where triggers meet the tiers and the gate.

RAM is the default; disk is reached only through `promote`, which re-runs the whole
eligibility gate with the authority of the caller at that moment — for every trigger, and for a
checkpoint that has been resident since the session began. Every decision is kept for `explain`.

Bytes move through a `PageMover`: in one process (`LocalPageMover`) copies happen at once; inside
vLLM the connector queues jobs for its workers and calls `on_stored` / `on_persisted` when they
report back. The logic here is the same either way.

A permitted persist starts once every page of its checkpoint is in the pool — its own copy may
be queued, or a page it shares may still be being copied for another checkpoint — and holds the
pages pinned (so the RAM entry cannot be evicted) until the blobs are written. Which tier holds
a checkpoint is read from the tiers themselves, never remembered: the disk tier may evict or
expire a record behind the manager's back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict

from kvci_plugin.governance import (
    EligibilityDecision,
    PersistenceEligibilityGate,
    PersistenceRequest,
    Trigger,
    get_persistence_eligibility_gate,
)
from kvci_plugin.policy import Offer
from kvci_plugin.tiering.catalog import KVCheckpointRecord
from kvci_plugin.tiering.disk_store import DiskStats, KVCheckpointStore
from kvci_plugin.tiering.health import DEPENDENCY_ERRORS, TierUnavailableError
from kvci_plugin.tiering.loadable import LoadablePages, TierListener
from kvci_plugin.tiering.ram_index import RAMIndex
from kvci_plugin.tiering.retention import RetentionOutcome, RetentionRefused, Retentions
from kvci_plugin.tiering.types import (
    CheckpointEntry,
    CheckpointFencedError,
    CheckpointForgottenError,
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
_NO_DISK = "refused: no disk tier is configured (disk_root)"
_MAX_FENCED = 4096  # RAM checkpoints a reset fenced that explain still names


class PageMover(Protocol):
    """Copies pages for the manager. Each call returns True when the copy is already done;
    False means it was queued and the manager hears back through `on_stored` / `on_persisted`."""

    def store(self, reservation: Reservation, source: Any) -> bool: ...

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool: ...


class PromotionOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    checkpoint_id: str
    status: Literal["persisting", "persisted", "refused", "failed"]
    reason: str
    decision: EligibilityDecision | None = None


class ResetOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    generation: int
    ram_checkpoints: int
    disk_checkpoints: int


class ForgetOutcome(BaseModel):
    """What a forget erased: RAM and disk checkpoints, and whether key material was destroyed."""

    model_config = ConfigDict(frozen=True)

    ram_checkpoints: int
    disk_checkpoints: int
    key_destroyed: bool


class CheckpointOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    checkpoint_id: str | None
    tier: Literal["ram", "none"]
    pending: bool
    reason: str
    new_pages: int = 0
    reused_pages: int = 0
    evicted: tuple[str, ...] = ()
    # The pages that left the RAM tier with those evictions (a page an evicted checkpoint shared
    # with a held one stays): what an admission policy learns "evicted before any hit" from.
    evicted_pages: tuple[PageKey, ...] = ()
    persist: PromotionOutcome | None = None
    retain: RetentionOutcome | None = None


@dataclass(frozen=True)
class RetainAsk:
    """An agent's retention ask: exempt from eviction for ``ttl_s`` seconds, or until the
    ``session``'s next request (None: the TTL only)."""

    ttl_s: float
    session: str | None


@dataclass
class _Persist:
    """A permitted persist between the gate's decision and its catalog row."""

    tenant: str
    keys: tuple[PageKey, ...]
    trigger: Trigger
    recommendation_json: str
    decision: EligibilityDecision
    writing: bool = False  # pages pinned and blobs being written; False: waiting for the RAM copy


class TieredCheckpointManager:
    def __init__(
        self,
        *,
        index: RAMIndex,
        mover: PageMover,
        advisor: CheckpointAdvisor | None = None,
        disk: KVCheckpointStore | None = None,
        disk_region: str | None = None,
        gate: PersistenceEligibilityGate | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.mover = mover
        self.advisor = advisor or CheckpointAdvisor()
        self.disk = disk
        self._disk_region = disk_region
        self._gate = gate  # None: whatever the seam holds at each evaluation
        self._clock = clock  # decides whether a disk record's retention has passed
        self.lock = threading.RLock()
        self._persists: dict[str, _Persist] = {}
        # The RAM-only generation (a disk tier keeps its own, in its catalog).
        self._generation = 0
        # Checkpoints a reset fenced: (tenant, when, generation begun), for explain; and the
        # writes under way then, whose report must record nothing.
        self._fenced: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        self._fenced_writes: set[str] = set()
        # Checkpoints a forget erased from RAM: (tenant, when), for explain (the disk tier's
        # are in its catalog).
        self._forgotten: OrderedDict[str, tuple[str, float]] = OrderedDict()
        # Only with a listener (kv events on): which pages each tier can load.
        self._loadable: LoadablePages | None = None
        # The tenant and trigger of each store still being copied: its pages become loadable
        # when it commits, and a system checkpoint then keeps the prefix its prompt re-sent.
        self._copying: dict[str, tuple[str, Trigger]] = {}
        self.retentions = Retentions(index, index.stats().tenant_quota_bytes)

    def watch(self, listener: TierListener) -> None:
        """Tell ``listener`` of pages as they become loadable from a tier and as they stop."""
        loadable = self._loadable = LoadablePages(listener)
        if self.disk is not None:
            self.disk.on_pages_removed = lambda keys: loadable.removed("disk", keys)

    def collect_expired(self) -> None:
        """With a listener: collect the durable checkpoints whose retention has passed, so that
        their pages are told removed when they stop being loadable rather than at the next write."""
        if (self._loadable is not None and self.disk is not None
                and self._loadable.expiry_due(self._clock())):
            with self.lock:
                self.disk.gc_expired(self._clock())

    @property
    def generation(self) -> int:
        """The generation KV is keyed in now: it moves at every cache reset."""
        return self.disk.generation if self.disk is not None else self._generation

    @property
    def gate(self) -> PersistenceEligibilityGate:
        return self._gate if self._gate is not None else get_persistence_eligibility_gate()

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
    ) -> CheckpointOutcome:
        """Keep `keys` in RAM now; `persist=True` also asks the gate for a durable copy;
        `retain` exempts the checkpoint from eviction for a while (RAM only).

        `offer` is what the RAM tier's policy weighs (None: one anchored at the last key,
        explicit unless the trigger is the system's); the policy may find a system offer worth
        less than what it would evict, and keep nothing.

        `source` is whatever the mover copies the new pages from. Input that could only fail at
        the gate (trigger, source ids) is checked first, so a bad call keeps nothing.
        """
        if trigger not in _TRIGGERS:
            raise ValueError(f"trigger must be one of {sorted(_TRIGGERS)}, not {trigger!r}")
        source_ids = _check_source_ids(source_ids)
        if not keys:
            return CheckpointOutcome(checkpoint_id=None, tier="none", pending=False,
                                     reason="no full block to keep")
        cid = uuid.uuid4().hex
        meta = {
            "trigger": trigger,
            "recommendation": recommendation.model_dump(mode="json") if recommendation else None,
            "source_ids": list(source_ids),
            "refusal": None,
            "decision": None,
            "persist_error": None,
        }
        with self.lock:
            retained = None  # a refusal, told whether or not the KV is kept
            if retain is not None:
                try:
                    self.retentions.check(tenant, keys)
                except RetentionRefused as exc:
                    retained = RetentionOutcome(status="refused", ttl_s=retain.ttl_s, reason=str(exc))
            try:
                # Without an offer, what the trigger says: only the system's own keeps are weighed.
                res = self.index.reserve(cid, tenant, keys, meta, offer=offer or Offer(
                    anchor=keys[-1], explicit=trigger != "system"))
            except (DoesNotFitError, TenantMismatchError) as exc:
                return CheckpointOutcome(checkpoint_id=None, tier="none", pending=False,
                                         reason=f"not kept in RAM: {exc}", retain=retained)
            # Asked at once, under the manager's lock: no reservation made through the manager
            # can have brought an evicted page back in between.
            evicted_pages = self.index.absent(key for e in res.evicted for key in e.keys)
            if self._loadable is not None:
                self._loadable.removed("ram", evicted_pages)
            if retained is None and retain is not None:
                retained = self.retentions.grant(cid, tenant, keys, retain.ttl_s, retain.session)
            done = True
            if res.new:
                try:
                    done = self.mover.store(res, source)
                except BaseException:
                    # Never leave a reservation that nothing will commit: its slots would leak.
                    self.index.abort(cid)
                    self.retentions.dropped(cid)
                    raise
            if done:
                self.index.commit(cid)
                self.retentions.committed()
                self._tell_ram_stored(cid, tenant)
                self._keep_resent_prefix(cid, trigger)
                if res.new:
                    self._start_ready_persists()
            else:
                self._copying[cid] = (tenant, trigger)
            persist_outcome = None
            if persist:
                persist_outcome = self.promote(
                    cid, tenant=tenant, trigger=trigger, session_token=session_token,
                    delegation_tokens=delegation_tokens)
        return CheckpointOutcome(
            checkpoint_id=cid, tier="ram", pending=not done, reason="kept in RAM",
            new_pages=len(res.new), reused_pages=len(res.reused),
            evicted=tuple(e.checkpoint_id for e in res.evicted), evicted_pages=evicted_pages,
            persist=persist_outcome, retain=retained)

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
            if checkpoint_id in self._fenced or checkpoint_id in self._forgotten:
                return None  # a copy of KV from before a reset or a forget: never loadable
            if ok:
                self.index.commit(checkpoint_id)
                self.retentions.committed()
                if tenant is not None:
                    self._tell_ram_stored(checkpoint_id, tenant)
                    self._keep_resent_prefix(checkpoint_id, trigger)
            else:
                keys = self.index.get(checkpoint_id, tenant).keys if tenant is not None else ()
                self.index.abort(checkpoint_id)
                self.retentions.dropped(checkpoint_id)
                if self._loadable is not None:
                    self._loadable.removed("ram", self.index.absent(keys))
                self._persists.pop(checkpoint_id, None)
            return self._start_ready_persists().get(checkpoint_id)

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
        write is under way, is not written again.
        """
        with self.lock:
            entry = self._ram_entry(checkpoint_id, tenant)
            unavailable: BaseException | None = None  # the gate still decides, and says why
            try:
                record = self._durable_record(checkpoint_id, tenant)
            except (TierUnavailableError, *DEPENDENCY_ERRORS) as exc:
                record, unavailable = None, exc
            if record is not None:
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisted",
                                        reason="already durable")
            if entry is None:
                raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held")
            in_flight = self._persists.get(checkpoint_id)
            if in_flight is not None:
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                        reason="a permitted write of this checkpoint is under way",
                                        decision=in_flight.decision)
            if self.disk is None:
                # Nothing could be written whatever the gate said: no decision is recorded.
                self.index.set_meta(checkpoint_id, refusal=_NO_DISK, decision=None)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="refused",
                                        reason=_NO_DISK)
            request = PersistenceRequest(
                checkpoint_id=checkpoint_id, tenant=tenant, trigger=trigger,
                session_token=session_token, delegation_tokens=tuple(delegation_tokens),
                source_ids=tuple(entry.meta.get("source_ids", ())),
                durable_store_region=self._disk_region)
            decision = self.gate.evaluate(request)
            dumped = decision.model_dump(mode="json")
            if not decision.permitted:
                self.index.set_meta(checkpoint_id, refusal=decision.reason, decision=dumped)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="refused",
                                        reason=decision.reason, decision=decision)
            try:
                if unavailable is not None:
                    raise unavailable
                self._clear_expired(checkpoint_id)
            except (TierUnavailableError, *DEPENDENCY_ERRORS) as exc:
                return self._disk_unavailable(checkpoint_id, exc, decision)
            self.index.set_meta(checkpoint_id, refusal=None, decision=dumped, persist_error=None)
            job = _Persist(tenant=entry.tenant, keys=entry.keys, trigger=trigger,
                           recommendation_json=json.dumps(entry.meta.get("recommendation")),
                           decision=decision)
            self._persists[checkpoint_id] = job
            if not entry.complete:
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                        reason="permitted; waiting for the RAM copy",
                                        decision=decision)
            return self._start_persist(checkpoint_id, job)

    def _disk_unavailable(self, checkpoint_id: str, exc: BaseException,
                          decision: EligibilityDecision | None = None) -> PromotionOutcome:
        """A persist the disk tier cannot take now (degraded, or failing): nothing is written,
        and the caller is told why; the RAM copy stays."""
        reason = f"persist failed: the disk tier is unavailable ({type(exc).__name__}: {exc})"
        self._set_meta_if_held(checkpoint_id, persist_error=reason)
        return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed", reason=reason,
                                decision=decision)

    def on_persisted(self, checkpoint_id: str, ok: bool, error: str = "") -> PromotionOutcome:
        """Every shard's blobs are durable (or one failed): record the catalog row, or the error.

        A report for a checkpoint with no write under way (a duplicate report) changes nothing.
        """
        with self.lock:
            if checkpoint_id in self._fenced_writes:
                self._fenced_writes.discard(checkpoint_id)
                assert self.disk is not None
                self.disk.end_lease(checkpoint_id)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                        reason="fenced by a cache reset or a forget: not recorded")
            job = self._persists.get(checkpoint_id)
            if job is None or not job.writing:
                logger.warning("kvci: persist report for %s, which has no write under way",
                               checkpoint_id)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                        reason="no write of this checkpoint is under way")
            del self._persists[checkpoint_id]
            self.index.unpin(job.keys)
            problem = self._record(checkpoint_id, job) if ok else (
                error or "the blob write reported a failure")
            if problem and not ok:
                self._release(checkpoint_id, job)
            if not problem and self._loadable is not None:
                self._loadable.stored("disk", job.keys)
                if job.decision.retention_expiry is not None:
                    self._loadable.expires(job.decision.retention_expiry)
            if problem:
                reason = f"persist failed: {problem}"
                self._set_meta_if_held(checkpoint_id, persist_error=reason)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                        reason=reason, decision=job.decision)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisted",
                                    reason=job.decision.reason, decision=job.decision)

    def _start_persist(self, checkpoint_id: str, job: _Persist) -> PromotionOutcome:
        # Pinned until the blobs are written: the slots cannot be reused, nor the entry evicted.
        slots = self.index.pin(job.keys, job.tenant)
        job.writing = True
        try:
            assert self.disk is not None  # a persist is only started with a disk tier
            # Leased before any blob is written, so that no node's eviction deletes a blob this
            # write finds and keeps; the lease ends with the catalog row or the failure.
            self.disk.reserve(checkpoint_id, job.keys)
            done = self.mover.persist(checkpoint_id, job.tenant, job.keys, slots)
        except Exception as exc:  # whatever failed, the pins must go and the failure be recorded
            return self.on_persisted(checkpoint_id, ok=False, error=f"{type(exc).__name__}: {exc}")
        if done:
            return self.on_persisted(checkpoint_id, ok=True)
        return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                reason="permitted; writing blobs", decision=job.decision)

    def _start_ready_persists(self) -> dict[str, PromotionOutcome]:
        """Start the waiting persists whose pages are all in the pool now; drop those that never
        can be (their entry is gone, or a page they share was left uncopied by a failed store)."""
        started: dict[str, PromotionOutcome] = {}
        for cid, job in list(self._persists.items()):
            if job.writing:
                continue
            try:
                entry = self.index.get(cid, job.tenant)
            except CheckpointNotFoundError:
                del self._persists[cid]
                continue
            if entry.complete:
                started[cid] = self._start_persist(cid, job)
            elif not entry.pending and not self._copy_pending_for(entry):
                del self._persists[cid]
                self.index.set_meta(cid, persist_error=(
                    "persist failed: a page shared with another checkpoint was never copied in "
                    "(that checkpoint's store failed)"))
        return started

    def _copy_pending_for(self, entry: CheckpointEntry) -> bool:
        """Whether a pending store could still bring in `entry`'s missing pages: only a pending
        checkpoint naming one of them can. Runs only for a persist stuck behind a failed store."""
        keys = set(entry.keys)
        return any(other.pending and not keys.isdisjoint(other.keys)
                   for other in self.index.entries(entry.tenant))

    def _release(self, checkpoint_id: str, job: _Persist) -> None:
        """End a failed write's lease; blobs it left that nothing else holds are deleted."""
        assert self.disk is not None
        try:
            self.disk.release(checkpoint_id, job.keys)
        except TierUnavailableError:
            pass  # the tier is degraded (logged once): the lease expires by itself
        except Exception as exc:  # the lease expires by itself; the failure is already reported
            logger.warning("kvci: releasing the lease of %s failed: %s", checkpoint_id, exc)

    def _record(self, checkpoint_id: str, job: _Persist) -> str:
        """Add the catalog row of written blobs; returns why it could not, or "" once it is."""
        assert self.disk is not None  # a persist is only started with a disk tier
        try:
            self.disk.record_written(
                checkpoint_id=checkpoint_id, tenant=job.tenant, keys=job.keys,
                slot_bytes=self.index.slot_bytes, trigger=job.trigger,
                recommendation_json=job.recommendation_json,
                decision_json=job.decision.model_dump_json(),
                retention_expiry=job.decision.retention_expiry)
        except Exception as exc:  # any failure (a refusal, the database) is this persist's
            # The disk tier has already deleted the blobs that no row or other write holds.
            return f"catalog row not written: {type(exc).__name__}: {exc}"
        return ""

    # ---- lifecycle ------------------------------------------------------------------------------

    def reset(self) -> ResetOutcome:
        """A cache reset (after an in-place weight update): no KV computed before it is ever
        loaded after it. RAM forgets every checkpoint, copies in flight included (their reports
        are ignored); the persists not yet recorded never are; the disk tier fences its
        generation for every node sharing its catalog. Keys move to the next generation."""
        with self.lock:
            now = self._clock()
            ram = self.index.entries()
            self.index.clear()
            self.retentions.clear()
            self._copying.clear()
            if self._loadable is not None:
                self._loadable.cleared("ram")
            self._fenced_writes.update(cid for cid, job in self._persists.items() if job.writing)
            self._persists.clear()
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
                for entry in ram:
                    self._fenced[entry.checkpoint_id] = (entry.tenant, now, generation)
                while len(self._fenced) > _MAX_FENCED:
                    self._fenced.popitem(last=False)
            return ResetOutcome(generation=generation, ram_checkpoints=len(ram),
                                disk_checkpoints=len(durable))

    def forget(self, tenant: str) -> ForgetOutcome:
        """Crypto-erase ``tenant`` (the caller checked the authority): RAM forgets its
        checkpoints (copies in flight included: their reports record nothing), its persists
        under way are never recorded, and the disk tier destroys its key material and rows for
        every node sharing the catalog, then its blobs. Other nodes' RAM tiers are theirs."""
        with self.lock:
            now = self._clock()
            ram = self.index.entries(tenant)
            for entry in ram:
                if entry.pending:
                    self.index.abort(entry.checkpoint_id)
                else:
                    self.index.remove(entry.checkpoint_id, tenant)
                self._forgotten[entry.checkpoint_id] = (tenant, now)
            while len(self._forgotten) > _MAX_FENCED:
                self._forgotten.popitem(last=False)
            if self._loadable is not None:  # kv events: the erased pages stop being loadable
                self._loadable.removed("ram", self.index.absent(k for e in ram for k in e.keys))
            for cid, job in list(self._persists.items()):
                if job.tenant == tenant:
                    if job.writing:
                        self._fenced_writes.add(cid)
                    del self._persists[cid]
            report = self.disk.forget(tenant) if self.disk is not None else None
        return ForgetOutcome(
            ram_checkpoints=len(ram),
            disk_checkpoints=0 if report is None else len(report.checkpoint_ids),
            key_destroyed=report is not None and report.key_destroyed)

    # ---- inspection -----------------------------------------------------------------------------

    def explain(self, checkpoint_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Why this checkpoint exists and why it is where it is (tenant-checked when given).

        Another tenant's checkpoint raises `TenantMismatchError` on either tier.
        """
        out: dict[str, Any] = {"checkpoint_id": checkpoint_id, "gate_in_force": self.gate.name}
        with self.lock:
            entry = self._ram_entry(checkpoint_id, tenant)
            try:
                record = self._durable_record(checkpoint_id, tenant)
            except (TierUnavailableError, *DEPENDENCY_ERRORS):
                if entry is None:
                    raise  # only the disk tier could say: the caller is told it is unavailable
                record = None  # RAM holds it; whether disk does too cannot be said now
            if entry is not None:
                job = self._persists.get(checkpoint_id)
                out.update(
                    tier="ram+disk" if record is not None else "ram", tenant=entry.tenant,
                    trigger=entry.meta.get("trigger"), pages=len(entry.keys),
                    bytes=entry.nbytes, created=entry.created, pending=entry.pending,
                    persisting=None if job is None else ("writing" if job.writing else "waiting"),
                    source_ids=list(entry.meta.get("source_ids", ())),
                    recommendation=entry.meta.get("recommendation"),
                    eligibility_decision=entry.meta.get("decision"),
                    refusal=entry.meta.get("refusal"),
                    persist_error=entry.meta.get("persist_error"),
                    retention_expiry=None if record is None else record.retention_expiry)
                return out
        if record is None:
            self._raise_if_fenced(checkpoint_id, tenant)
            self._raise_if_forgotten(checkpoint_id, tenant)
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held")
        out.update(
            tier="disk", tenant=record.tenant, trigger=record.trigger, pages=len(record.pages),
            bytes=record.nbytes, created=record.created, pending=False, persisting=None,
            retention_expiry=record.retention_expiry,
            recommendation=json.loads(record.recommendation_json),
            eligibility_decision=json.loads(record.decision_json), refusal=None,
            persist_error=None)
        return out

    def ram_stats(self) -> dict[str, Any]:
        """Occupancy, the gate in force and the registered scorers (a score means nothing
        without knowing what produced it)."""
        s = self.index.stats()
        with self.lock:
            persists = len(self._persists)
            r = self.retentions.stats()
        return {
            "entries": s.entries, "pending_entries": s.pending_entries, "pages": s.pages,
            "pinned_pages": s.pinned_pages, "bytes_used": s.bytes_used,
            "capacity_bytes": s.capacity_bytes, "max_entries": s.max_entries,
            "slot_bytes": s.slot_bytes, "evictions": s.evictions, "policy": asdict(s.policy),
            "tenant_bytes": dict(s.tenant_bytes), "tenant_quota_bytes": s.tenant_quota_bytes,
            "persists_in_flight": persists,
            "retentions": r.retentions, "retained_bytes": r.retained_bytes,
            "tenant_retained_bytes": r.tenant_retained_bytes,
            "retentions_expired": r.expired, "retentions_released": r.released,
            "gate_in_force": self.gate.name,
            "scorers": {e.name: e.weight for e in self.advisor.registry.entries()},
            "disk": None if self.disk is None else self._disk_stats(self.disk),
        }

    @staticmethod
    def _disk_stats(disk: KVCheckpointStore) -> dict[str, Any]:
        """The disk tier's counts and health; while its catalog does not answer, its health
        alone (the counts are None)."""
        try:
            counts = asdict(disk.stats())
        except Exception:  # degraded, or failing now: the health says which and since when
            counts = {f.name: None for f in fields(DiskStats)}
        return {**counts, "health": asdict(disk.health_report())}

    def _raise_if_fenced(self, checkpoint_id: str, tenant: str | None) -> None:
        """CheckpointFencedError when a reset fenced it (and it is the caller's, if one is named)."""
        fenced = self._fenced.get(checkpoint_id)
        if fenced is None and self.disk is not None:
            fenced = self.disk.fenced(checkpoint_id)
        if fenced is not None and tenant in (None, fenced[0]):
            raise CheckpointFencedError(checkpoint_id, fenced[1], fenced[2])

    def _raise_if_forgotten(self, checkpoint_id: str, tenant: str | None) -> None:
        """CheckpointForgottenError when a forget erased it (and it is the caller's, if named)."""
        forgotten = self._forgotten.get(checkpoint_id)
        if forgotten is None and self.disk is not None:
            forgotten = self.disk.forgotten(checkpoint_id)
        if forgotten is not None and tenant in (None, forgotten[0]):
            raise CheckpointForgottenError(checkpoint_id, forgotten[1])

    # ---- helpers (caller holds the lock) --------------------------------------------------------

    def _tell_ram_stored(self, checkpoint_id: str, tenant: str) -> None:
        """The committed checkpoint's pages that are loadable now (a page it shares may still be
        being copied in by another store, which tells it when that one commits)."""
        if self._loadable is None:
            return
        keys = self.index.get(checkpoint_id, tenant).keys
        held = self._loadable.held("ram")
        self._loadable.stored("ram", [k for k in keys if k not in held
                                      and self.index.longest_prefix((k,), tenant)])

    def _keep_resent_prefix(self, checkpoint_id: str, trigger: Trigger | None) -> None:
        """A checkpoint the system kept committed: the prefix its prompt re-sent keeps a value of
        its own (``RAMIndex.keep_resent_prefix``). An explicit one needs none: it leaves last."""
        if trigger == "system":
            self.index.keep_resent_prefix(checkpoint_id, uuid.uuid4().hex)

    def _ram_entry(self, checkpoint_id: str, tenant: str | None) -> CheckpointEntry | None:
        """The RAM record, None when RAM does not hold it; another tenant's raises."""
        if tenant is not None:
            try:
                return self.index.get(checkpoint_id, tenant)
            except CheckpointNotFoundError:
                return None
        # Only explain without a tenant (operator tools) gets here: RAMIndex looks ids up by
        # tenant, so this scans.
        return next((e for e in self.index.entries() if e.checkpoint_id == checkpoint_id), None)

    def _durable_record(self, checkpoint_id: str, tenant: str | None) -> KVCheckpointRecord | None:
        """The live disk record, None when there is none or its retention has passed; another
        tenant's raises (the message does not name its owner)."""
        if self.disk is None:
            return None
        record = self.disk.explain(checkpoint_id)
        if record is None or _expired(record, self._clock()):
            return None
        if tenant is not None and record.tenant != tenant:
            raise TenantMismatchError(
                f"checkpoint {checkpoint_id!r} belongs to another tenant: refused")
        return record

    def _clear_expired(self, checkpoint_id: str) -> None:
        """An expired record not yet collected would block the row of a new write of the id."""
        assert self.disk is not None
        record = self.disk.explain(checkpoint_id)
        if record is not None and _expired(record, self._clock()):
            self.disk.gc_expired(self._clock())

    def _set_meta_if_held(self, checkpoint_id: str, **values: Any) -> None:
        try:
            self.index.set_meta(checkpoint_id, **values)
        except CheckpointNotFoundError:
            pass  # removed from RAM meanwhile; the disk tier's row (if any) is the record now


def _expired(record: KVCheckpointRecord, now: float) -> bool:
    return record.retention_expiry is not None and record.retention_expiry <= now


def _check_source_ids(source_ids: Iterable[str]) -> tuple[str, ...]:
    if isinstance(source_ids, (str, bytes)):
        raise TypeError("source_ids must be a sequence of source ids, not a single str/bytes")
    ids = tuple(source_ids)
    for i, source_id in enumerate(ids):
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"source_ids[{i}] must be a non-empty string, not {source_id!r}")
    return ids
