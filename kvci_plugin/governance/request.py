"""A request to write one checkpoint to the durable store."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Trigger = Literal["system", "user", "agent"]


class PersistenceRequest(BaseModel):
    """Everything the gate needs, and nothing that could grant authority by itself.

    `trigger` is provenance only: every trigger is gated identically, so claiming "user"
    buys nothing. Authority comes from the credentials alone, verified at evaluation time.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    checkpoint_id: str = Field(min_length=1)
    tenant: str = Field(min_length=1, description="the tenant the checkpoint belongs to")
    trigger: Trigger
    # Bearer credentials: kept out of repr so that a logged request does not leak them.
    session_token: str | None = Field(default=None, repr=False)
    delegation_tokens: tuple[str, ...] = Field(default=(), repr=False, description="root to leaf")
    source_ids: tuple[str, ...] = Field(
        default=(), description="every source the KV was derived from"
    )
    durable_store_region: str | None = Field(default=None, min_length=1)

    @field_validator("source_ids")
    @classmethod
    def _distinct_named_sources(cls, source_ids: tuple[str, ...]) -> tuple[str, ...]:
        if any(not source_id for source_id in source_ids):
            raise ValueError("source_ids must not contain an empty id")
        # The same source listed twice contributes once; order kept for a readable derivation.
        return tuple(dict.fromkeys(source_ids))
