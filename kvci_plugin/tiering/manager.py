"""TieredCheckpointManager: the seed's one place where triggers meet the tiers and the gate.

RAM is the default; disk is reached only through `promote`, which re-runs the whole
eligibility gate with the authority of the caller at that moment — for every trigger, and for a
checkpoint that has been resident since the session began. Every decision is kept for `explain`.

Bytes move through a `PageMover`: in one process (`LocalPageMover`) copies happen at once; inside
vLLM the connector queues jobs for its workers and calls `on_stored` / `on_persisted` when they
report back. The logic here is the same either way.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from kvci_plugin.governance import (
    EligibilityDecision,
    PersistenceEligibilityGate,
    PersistenceRequest,
    get_persistence_eligibility_gate,
)
from kvci_plugin.tiering.disk_store import KVCheckpointStore
from kvci_plugin.tiering.ram_index import RAMIndex
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

TriggerName = Literal["system", "user", "agent"]


class PageMover(Protocol):
    """Copies pages for the manager. Each call returns True when the copy is already done."""

    def store(self, reservation: Reservation, source: Any) -> bool: ...

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool: ...


class PromotionOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    checkpoint_id: str
    status: Literal["persisting", "persisted", "refused", "failed"]
    reason: str
    decision: EligibilityDecision | None = None


class CheckpointOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    checkpoint_id: str | None
    tier: Literal["ram", "none"]
    pending: bool
    reason: str
    new_pages: int = 0
    reused_pages: int = 0
    evicted: tuple[str, ...] = ()
    persist: PromotionOutcome | None = None


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
        self._clock = clock
        self.lock = threading.RLock()
        # Persists waiting for their RAM copy to land: checkpoint id -> permitted decision.
        self._persist_after_store: dict[str, EligibilityDecision] = {}

    @property
    def gate(self) -> PersistenceEligibilityGate:
        return self._gate if self._gate is not None else get_persistence_eligibility_gate()

    # ---- scoring ------------------------------------------------------------------------------

    def recommend(self, observation: CheckpointObservation) -> CheckpointRecommendation:
        """Score a moment and publish the verdict for this task's advisory; takes no checkpoint."""
        rec = self.advisor.recommend(observation)
        publish_recommendation(rec)
        return rec

    # ---- RAM ------------------------------------------------------------------------------------

    def checkpoint_now(
        self,
        *,
        tenant: str,
        keys: Sequence[PageKey],
        trigger: TriggerName,
        recommendation: CheckpointRecommendation | None,
        source: Any,
        source_ids: Sequence[str] = (),
        persist: bool = False,
        session_token: str | None = None,
        delegation_tokens: Sequence[str] = (),
    ) -> CheckpointOutcome:
        """Keep `keys` in RAM now; `persist=True` also asks the gate for a durable copy."""
        if not keys:
            return CheckpointOutcome(checkpoint_id=None, tier="none", pending=False,
                                     reason="no full block to keep")
        cid = uuid.uuid4().hex
        meta = {
            "trigger": trigger,
            "recommendation": recommendation.model_dump(mode="json") if recommendation else None,
            "source_ids": list(source_ids),
            "tier": "ram",
            "refusal": None,
            "decision": None,
            "persisted": False,
        }
        with self.lock:
            try:
                res = self.index.reserve(cid, tenant, keys, meta)
            except (DoesNotFitError, TenantMismatchError) as exc:
                return CheckpointOutcome(checkpoint_id=None, tier="none", pending=False,
                                         reason=f"not kept in RAM: {exc}")
            done = not res.new or self.mover.store(res, source)
            if done:
                self.index.commit(cid)
            persist_outcome = None
            if persist:
                persist_outcome = self.promote(
                    cid, tenant=tenant, trigger=trigger, session_token=session_token,
                    delegation_tokens=delegation_tokens)
        return CheckpointOutcome(
            checkpoint_id=cid, tier="ram", pending=not done, reason="kept in RAM",
            new_pages=len(res.new), reused_pages=len(res.reused),
            evicted=tuple(e.checkpoint_id for e in res.evicted), persist=persist_outcome)

    def on_stored(self, checkpoint_id: str, ok: bool) -> PromotionOutcome | None:
        """A queued RAM copy finished; starts a persist that was waiting for it."""
        with self.lock:
            if not ok:
                self._persist_after_store.pop(checkpoint_id, None)
                self.index.abort(checkpoint_id)
                return None
            self.index.commit(checkpoint_id)
            decision = self._persist_after_store.pop(checkpoint_id, None)
            if decision is None:
                return None
            return self._start_persist(checkpoint_id, decision)

    # ---- disk -----------------------------------------------------------------------------------

    def promote(
        self,
        checkpoint_id: str,
        *,
        tenant: str,
        trigger: TriggerName,
        session_token: str | None,
        delegation_tokens: Sequence[str] = (),
    ) -> PromotionOutcome:
        """RAM -> disk through the gate, with authority derived now from these credentials."""
        with self.lock:
            entry = self.index.get(checkpoint_id, tenant)  # fails closed across tenants
            if entry.meta.get("persisted"):
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisted",
                                        reason="already durable")
            request = PersistenceRequest(
                checkpoint_id=checkpoint_id, tenant=tenant, trigger=trigger,
                session_token=session_token, delegation_tokens=tuple(delegation_tokens),
                source_ids=tuple(entry.meta.get("source_ids", ())),
                durable_store_region=self._disk_region)
            decision = self.gate.evaluate(request)
            if decision.permitted and self.disk is None:
                decision = None
                reason = "refused: no disk tier is configured (disk_root)"
                self.index.set_meta(checkpoint_id, refusal=reason, decision=None)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="refused",
                                        reason=reason)
            if not decision.permitted:
                self.index.set_meta(checkpoint_id, refusal=decision.reason,
                                    decision=decision.model_dump(mode="json"))
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="refused",
                                        reason=decision.reason, decision=decision)
            self.index.set_meta(checkpoint_id, refusal=None, decision=decision.model_dump(mode="json"),
                                persist_trigger=trigger)
            if entry.pending:
                self._persist_after_store[checkpoint_id] = decision
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                        reason="permitted; waiting for the RAM copy",
                                        decision=decision)
            return self._start_persist(checkpoint_id, decision)

    def _start_persist(self, checkpoint_id: str, decision: EligibilityDecision) -> PromotionOutcome:
        entry = self.index.get(checkpoint_id, decision_tenant(self.index, checkpoint_id))
        slots = self.index.pin(entry.keys, entry.tenant)  # held until the blobs are written
        self.index.set_meta(checkpoint_id, persisting=True)
        if self.mover.persist(checkpoint_id, entry.tenant, entry.keys, slots):
            return self.on_persisted(checkpoint_id, ok=True)
        return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisting",
                                reason="permitted; writing blobs", decision=decision)

    def on_persisted(self, checkpoint_id: str, ok: bool, error: str = "") -> PromotionOutcome:
        """Every shard's blobs are durable (or one failed): record the catalog row, or the error."""
        with self.lock:
            tenant = decision_tenant(self.index, checkpoint_id)
            entry = self.index.get(checkpoint_id, tenant)
            self.index.unpin(entry.keys)
            decision = EligibilityDecision.model_validate(entry.meta["decision"])
            if not ok:
                self.index.set_meta(checkpoint_id, persisting=False, persist_error=error)
                return PromotionOutcome(checkpoint_id=checkpoint_id, status="failed",
                                        reason=f"blob write failed: {error}", decision=decision)
            assert self.disk is not None
            rec = entry.meta.get("recommendation")
            self.disk.record_written(
                checkpoint_id=checkpoint_id, tenant=tenant, keys=entry.keys,
                slot_bytes=self.index.slot_bytes,
                trigger=entry.meta.get("persist_trigger", entry.meta["trigger"]),
                recommendation_json=json.dumps(rec), decision_json=decision.model_dump_json(),
                retention_expiry=decision.retention_expiry)
            self.index.set_meta(checkpoint_id, persisting=False, persisted=True, tier="ram+disk")
            return PromotionOutcome(checkpoint_id=checkpoint_id, status="persisted",
                                    reason=decision.reason, decision=decision)

    # ---- inspection -----------------------------------------------------------------------------

    def explain(self, checkpoint_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Why this checkpoint exists and why it is where it is (tenant-checked when given)."""
        gate = self.gate
        out: dict[str, Any] = {"checkpoint_id": checkpoint_id, "gate_in_force": gate.name}
        with self.lock:
            try:
                entry = self.index.get(checkpoint_id, tenant or decision_tenant(self.index, checkpoint_id))
            except CheckpointNotFoundError:
                entry = None
            if entry is not None:
                out.update(
                    tier=entry.meta.get("tier", "ram"), tenant=entry.tenant,
                    trigger=entry.meta.get("trigger"), pages=len(entry.keys),
                    bytes=entry.nbytes, created=entry.created, pending=entry.pending,
                    recommendation=entry.meta.get("recommendation"),
                    eligibility_decision=entry.meta.get("decision"),
                    refusal=entry.meta.get("refusal"),
                    persist_error=entry.meta.get("persist_error"))
                return out
        record = self.disk.explain(checkpoint_id) if self.disk is not None else None
        if record is None or (tenant is not None and record.tenant != tenant):
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held")
        out.update(
            tier="disk", tenant=record.tenant, trigger=record.trigger, pages=len(record.pages),
            bytes=record.nbytes, created=record.created, pending=False,
            retention_expiry=record.retention_expiry,
            recommendation=json.loads(record.recommendation_json),
            eligibility_decision=json.loads(record.decision_json), refusal=None)
        return out

    def ram_stats(self) -> dict[str, Any]:
        """Occupancy, the gate in force and the registered scorers (a score means nothing
        without knowing what produced it)."""
        s = self.index.stats()
        return {
            "entries": s.entries, "pending_entries": s.pending_entries, "pages": s.pages,
            "pinned_pages": s.pinned_pages, "bytes_used": s.bytes_used,
            "capacity_bytes": s.capacity_bytes, "max_entries": s.max_entries,
            "slot_bytes": s.slot_bytes, "evictions": s.evictions,
            "tenant_bytes": dict(s.tenant_bytes), "tenant_quota_bytes": s.tenant_quota_bytes,
            "gate_in_force": self.gate.name,
            "scorers": {e.name: e.weight for e in self.advisor.registry.entries()},
            "disk": None if self.disk is None else self.disk.stats().__dict__,
        }


def decision_tenant(index: RAMIndex, checkpoint_id: str) -> str:
    """The tenant a held checkpoint belongs to (internal: callers from outside pass their own)."""
    for entry in index.entries():
        if entry.checkpoint_id == checkpoint_id:
            return entry.tenant
    raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} is not held in RAM")
