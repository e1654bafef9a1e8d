"""What kvci decided for one request when the scheduler first saw it, and how it is told back
to the client."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from kvci_plugin.governance import EligibilityDecision, Trigger
from kvci_plugin.worthiness import CheckpointRecommendation, render_advisory

# Named in every reply: the decision precedes the output, so it cannot have measured it.
DECIDED_AT = "admission"


class SaveDecision(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str
    # LMCache may store the request's chunks (its CPU tier, and whatever else it is configured
    # with).
    save: bool
    # kvci's gated durable tiers may take them; `retention_expiry` is the permit's (None = no
    # limit).
    durable: bool
    retention_expiry: float | None = None
    trigger: Trigger | None = None
    reasons: tuple[str, ...]
    recommendation: CheckpointRecommendation | None = None
    persist: EligibilityDecision | None = None
    error: str | None = None
    # The client sent a kvci object; only then is anything said back.
    client_asked: bool

    @model_validator(mode="after")
    def _consistent(self) -> SaveDecision:
        if self.durable and not self.save:
            raise ValueError("a durable decision must also save")
        if self.durable and (self.persist is None or not self.persist.permitted):
            raise ValueError("a durable decision needs the gate's permit")
        if not self.durable and self.retention_expiry is not None:
            raise ValueError("retention_expiry belongs to a durable decision")
        return self

    def reply(self) -> dict[str, Any]:
        """The `kvci` object of the response's kv_transfer_params."""
        if self.error is not None:
            return {"error": self.error, "decided_at": DECIDED_AT, "save": self.save,
                    "durable": self.durable, "reasons": list(self.reasons)}
        rec = self.recommendation
        return {
            "decided_at": DECIDED_AT,
            "save": self.save,
            "durable": self.durable,
            "retention_expiry": self.retention_expiry,
            "trigger": self.trigger,
            "reasons": list(self.reasons),
            "recommendation": rec.model_dump(mode="json") if rec is not None else None,
            "advisory": render_advisory(rec) if rec is not None else "",
            "persist": self.persist.model_dump(mode="json") if self.persist is not None else None,
        }
