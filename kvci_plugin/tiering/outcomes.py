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
    # Checkpoints that gave up only their tails for room (they hold their heads on).
    trimmed: tuple[str, ...] = ()
    # The pages that left the RAM tier with those evictions (a page an evicted checkpoint shared
    # with a held one stays): what an admission policy learns "evicted before any hit" from.
    evicted_pages: tuple[PageKey, ...] = ()
    persist: PromotionOutcome | None = None
    retain: RetentionOutcome | None = None


@dataclass(frozen=True)
class RetainAsk:
    """An agent's retention ask: exempt from eviction for ``ttl_s`` seconds, or until the
    ``session``'s next request (None: the TTL only). ``word``: whose order it is — the client's
    ``kvci.retain``, a ``kvci.retain`` action of vLLM's KV hints, or the engine's automatic
    retention of a tool call's pause; ``priority``: a KV hint's; ``asked_ttl_s``: the TTL asked
    when it was trimmed to the engine's bound (None: granted as asked); ``session_by``: who named
    the session, the client (``kvci.session_id``) or vLLM (its ``Request.session_id``)."""

    ttl_s: float
    session: str | None
    word: Literal["client", "kv_hints", "engine"] = "client"
    priority: int | None = None
    asked_ttl_s: float | None = None
    session_by: Literal["client", "vllm"] = "client"

    def describe(self, outcome: RetentionOutcome) -> dict[str, object]:
        """What the reply and ``explain`` say of this ask and what became of it."""
        out: dict[str, object] = {**outcome.model_dump(mode="json"), "by": self.word}
        if self.priority is not None:
            out["priority"] = self.priority
        if self.asked_ttl_s is not None:
            out["asked_ttl_s"] = self.asked_ttl_s
        if self.session is not None:
            out["session"] = {"id": self.session, "by": self.session_by}
        return out
