"""What the manager's calls answer: a checkpoint kept (or not), a persist, a cache reset, a
forget; and the retention an agent asks for. Plain values the connector and the control surface
read and return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvci_plugin.governance import EligibilityDecision
from kvci_plugin.tiering.ram.retention import RetentionOutcome
from kvci_plugin.tiering.types import PageKey


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
