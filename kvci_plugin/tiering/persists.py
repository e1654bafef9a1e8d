"""The persist state machine: a permitted persist, from the gate's decision to its catalog row.

``promote`` is the one way to the disk tier: it re-runs the whole eligibility gate with the
authority of the caller at that moment — for every trigger, and for a checkpoint resident since
the session began. A permitted persist waits until every page of its checkpoint is in the pool
(its own copy may be queued, or a page it shares may still be being copied for another
checkpoint), then pins the pages (so the RAM entry cannot be evicted), leases them on the disk
tier and has the mover write the blobs; the write's report (``on_persisted``) records the
catalog row, or why not, and unpins. A cache reset or a forget fences the writes under way:
their reports record nothing.

The manager owns one ``Persists`` and holds its lock around every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvci_plugin.governance import (
    EligibilityDecision,
    PersistenceEligibilityGate,
    PersistenceRequest,
    Trigger,
)
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.explain import durable_record, expired, ram_entry
from kvci_plugin.tiering.health import DEPENDENCY_ERRORS, TierUnavailableError
from kvci_plugin.tiering.loadable import LoadablePages
from kvci_plugin.tiering.mover import PageMover
from kvci_plugin.tiering.outcomes import PromotionOutcome
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import CheckpointEntry, CheckpointNotFoundError, PageKey

logger = logging.getLogger(__name__)

_NO_DISK = "refused: no disk tier is configured (disk_root)"


class PersistHost(Protocol):
    """What the persists need of the manager: its tiers as they are now (a disk tier that did
    not answer at start is attached later), the gate in force, the mover, the loadable pages."""

    index: RAMIndex
    mover: PageMover
    disk: KVCheckpointStore | None

    @property
    def disk_attaching(self) -> bool: ...

    @property
    def gate(self) -> PersistenceEligibilityGate: ...

    @property
    def loadable(self) -> LoadablePages | None: ...

    def erased_at(self, tenant: str) -> int: ...


@dataclass
class Persist:
    """A permitted persist between the gate's decision and its catalog row."""

    tenant: str
    keys: tuple[PageKey, ...]
    trigger: Trigger
    recommendation_json: str
    decision: EligibilityDecision
    writing: bool = False  # pages pinned and blobs being written; False: waiting for the RAM copy
    epoch: int | None = None  # the erasure epoch known when its KV was computed (None: unknown)


class Persists:
    """The permitted persists under way, and the writes a reset or a forget fenced."""

    def __init__(self, host: PersistHost, *, disk_region: str | None,
                 clock: Callable[[], float]) -> None:
        self._host = host
        self._disk_region = disk_region
        self._clock = clock  # decides whether a disk record's retention has passed
        self._jobs: dict[str, Persist] = {}
        # The writes under way at a reset or a forget, whose report must record nothing: each
        # with the keys its pages are pinned by until that report (none after a reset: the
        # index that pinned them is gone).
        self._fenced_writes: dict[str, tuple[PageKey, ...]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def state(self, checkpoint_id: str) -> Literal["writing", "waiting"] | None:
        """Where a persist of the checkpoint is: writing its blobs, waiting for its RAM copy, or
        None when there is none."""
        job = self._jobs.get(checkpoint_id)
        return None if job is None else ("writing" if job.writing else "waiting")

    def drop(self, checkpoint_id: str) -> None:
        """The checkpoint's RAM copy failed: its persist never starts."""
        self._jobs.pop(checkpoint_id, None)

    def fence_all(self) -> None:
        """A cache reset: no persist under way is ever recorded (the writes' reports record
        nothing; the index that pinned their pages is cleared)."""
        self._fenced_writes = dict.fromkeys(
            [*self._fenced_writes, *(cid for cid, job in self._jobs.items() if job.writing)], ())
        self._jobs.clear()

    def fence_tenant(self, tenant: str) -> None:
        """A forget of ``tenant``: none of its persists under way is ever recorded."""
        for cid, job in list(self._jobs.items()):
            if job.tenant == tenant:
                if job.writing:
                    self._fenced_writes[cid] = job.keys
                del self._jobs[cid]

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
        entry = ram_entry(self._host.index, checkpoint_id, tenant)
        unavailable: BaseException | None = None  # the gate still decides, and says why
        try:
            record = durable_record(self._host.disk, checkpoint_id, tenant, self._clock())
        except (TierUnavailableError, *DEPENDENCY_ERRORS) as exc:
            record, unavailable = None, exc
        if record is not None:
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisted",
                                    reason="already durable")
        if entry is None:
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held")
        in_flight = self._jobs.get(checkpoint_id)
        if in_flight is not None:
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                    reason="a permitted write of this checkpoint is under way",
                                    decision=in_flight.decision)
        disk = self._host.disk
        if disk is None and self._host.disk_attaching:
            unavailable = TierUnavailableError("it has not answered since the engine started")
        elif disk is None:
            # Nothing could be written whatever the gate said: no decision is recorded.
            self._host.index.set_meta(checkpoint_id, refusal=_NO_DISK, decision=None)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="refused",
                                    reason=_NO_DISK)
        request = PersistenceRequest(
            checkpoint_id=checkpoint_id, tenant=tenant, trigger=trigger,
            session_token=session_token, delegation_tokens=tuple(delegation_tokens),
            source_ids=tuple(entry.meta.get("source_ids", ())),
            durable_store_region=self._disk_region)
        decision = self._host.gate.evaluate(request)
        dumped = decision.model_dump(mode="json")
        if not decision.permitted:
            self._host.index.set_meta(checkpoint_id, refusal=decision.reason, decision=dumped)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="refused",
                                    reason=decision.reason, decision=decision)
        try:
            if unavailable is not None:
                raise unavailable
            self._clear_expired(checkpoint_id)
        except (TierUnavailableError, *DEPENDENCY_ERRORS) as exc:
            return self._disk_unavailable(checkpoint_id, exc, decision)
        self._host.index.set_meta(checkpoint_id, refusal=None, decision=dumped, persist_error=None)
        job = Persist(tenant=entry.tenant, keys=entry.keys, trigger=trigger,
                      recommendation_json=entry.meta.get("recommendation") or "null",
                      decision=decision, epoch=entry.meta.get("erasure_epoch"))
        self._jobs[checkpoint_id] = job
        if not entry.complete:
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                    reason="permitted; waiting for the RAM copy",
                                    decision=decision)
        return self._start(checkpoint_id, job)

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
        if checkpoint_id in self._fenced_writes:
            # Its pages were erased or cleared: once unpinned, nothing holds them.
            self._host.index.unpin(self._fenced_writes.pop(checkpoint_id))
            disk = self._host.disk
            assert disk is not None
            disk.end_lease(checkpoint_id)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                    reason="fenced by a cache reset or a forget: not recorded")
        job = self._jobs.get(checkpoint_id)
        if job is None or not job.writing:
            logger.warning("kvci: persist report for %s, which has no write under way",
                           checkpoint_id)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                    reason="no write of this checkpoint is under way")
        del self._jobs[checkpoint_id]
        self._host.index.unpin(job.keys)
        problem = self._record(checkpoint_id, job) if ok else (
            error or "the blob write reported a failure")
        if problem and not ok:
            self._release(checkpoint_id, job)
        if not problem and self._host.loadable is not None:
            self._host.loadable.stored("disk", job.keys)
            if job.decision.retention_expiry is not None:
                self._host.loadable.expires(job.decision.retention_expiry)
        if problem:
            reason = f"persist failed: {problem}"
            self._set_meta_if_held(checkpoint_id, persist_error=reason)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                    reason=reason, decision=job.decision)
        return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisted",
                                reason=job.decision.reason, decision=job.decision)

    def start_ready(self) -> dict[str, PromotionOutcome]:
        """Start the waiting persists whose pages are all in the pool now; drop those that never
        can be (their entry is gone, or a page they share was left uncopied by a failed store)."""
        started: dict[str, PromotionOutcome] = {}
        for cid, job in list(self._jobs.items()):
            if job.writing:
                continue
            try:
                entry = self._host.index.get(cid, job.tenant)
            except CheckpointNotFoundError:
                del self._jobs[cid]
                continue
            if entry.complete:
                started[cid] = self._start(cid, job)
            elif not entry.pending and not self._copy_pending_for(entry):
                del self._jobs[cid]
                self._host.index.set_meta(cid, persist_error=(
                    "persist failed: a page shared with another checkpoint was never copied in "
                    "(that checkpoint's store failed)"))
        return started

    def _start(self, checkpoint_id: str, job: Persist) -> PromotionOutcome:
        if job.epoch is not None and job.epoch < self._host.erased_at(job.tenant):
            # Computed before a forget of its tenant this node knows of: nothing is leased.
            del self._jobs[checkpoint_id]
            reason = "persist failed: its KV was computed before its tenant was forgotten"
            self._set_meta_if_held(checkpoint_id, persist_error=reason)
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed", reason=reason,
                                    decision=job.decision)
        # Pinned until the blobs are written: the slots cannot be reused, nor the entry evicted.
        slots = self._host.index.pin(job.keys, job.tenant)
        job.writing = True
        try:
            disk = self._host.disk
            assert disk is not None  # a persist is only started with a disk tier
            # Leased before any blob is written, so that no node's eviction deletes a blob this
            # write finds and keeps; the lease ends with the catalog row or the failure.
            disk.reserve(checkpoint_id, job.keys, job.tenant, job.epoch)
            done = self._host.mover.persist(checkpoint_id, job.tenant, job.keys, slots)
        except Exception as exc:  # whatever failed, the pins must go and the failure be recorded
            return self.on_persisted(checkpoint_id, ok=False, error=f"{type(exc).__name__}: {exc}")
        if done:
            return self.on_persisted(checkpoint_id, ok=True)
        return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                reason="permitted; writing blobs", decision=job.decision)

    def _copy_pending_for(self, entry: CheckpointEntry) -> bool:
        """Whether a pending store could still bring in `entry`'s missing pages: only a pending
        checkpoint naming one of them can. Runs only for a persist stuck behind a failed store."""
        keys = set(entry.keys)
        return any(other.pending and not keys.isdisjoint(other.keys)
                   for other in self._host.index.entries(entry.tenant))

    def _release(self, checkpoint_id: str, job: Persist) -> None:
        """End a failed write's lease; blobs it left that nothing else holds are deleted."""
        disk = self._host.disk
        assert disk is not None
        try:
            disk.release(checkpoint_id, job.keys)
        except TierUnavailableError:
            pass  # the tier is degraded (logged once): the lease expires by itself
        except Exception as exc:  # the lease expires by itself; the failure is already reported
            logger.warning("kvci: releasing the lease of %s failed: %s", checkpoint_id, exc)

    def _record(self, checkpoint_id: str, job: Persist) -> str:
        """Add the catalog row of written blobs; returns why it could not, or "" once it is."""
        disk = self._host.disk
        assert disk is not None  # a persist is only started with a disk tier
        try:
            disk.record_written(
                checkpoint_id=checkpoint_id, tenant=job.tenant, keys=job.keys,
                slot_bytes=self._host.index.slot_bytes, trigger=job.trigger,
                recommendation_json=job.recommendation_json,
                decision_json=job.decision.model_dump_json(),
                retention_expiry=job.decision.retention_expiry, computed_epoch=job.epoch)
        except Exception as exc:  # any failure (a refusal, the database) is this persist's
            # The disk tier has already deleted the blobs that no row or other write holds.
            return f"catalog row not written: {type(exc).__name__}: {exc}"
        return ""

    def _clear_expired(self, checkpoint_id: str) -> None:
        """An expired record not yet collected would block the row of a new write of the id."""
        disk = self._host.disk
        assert disk is not None
        record = disk.explain(checkpoint_id)
        if record is not None and expired(record, self._clock()):
            disk.gc_expired(self._clock())

    def _set_meta_if_held(self, checkpoint_id: str, **values: Any) -> None:
        try:
            self._host.index.set_meta(checkpoint_id, **values)
        except CheckpointNotFoundError:
            pass  # removed from RAM meanwhile; the disk tier's row (if any) is the record now
