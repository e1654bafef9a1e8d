"""kvci's settings for the LMCache facade: the `kvci` object of `kv_connector_extra_config`.

LMCache reads its own `lmcache.*` keys from the same dict; kvci's keys live under one `kvci`
key so that neither reads the other's. Unknown keys are an error, and nothing here widens what
reaches LMCache's durable tiers: that is decided by the eligibility gate alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvci_plugin.governance import CredentialConfig

EXTRA_CONFIG_KEY = "kvci"


class KVCILMCacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    system_trigger: bool = Field(
        True,
        description="let LMCache save a request the recommendation finds worth keeping, unasked",
    )
    ram_threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="advisor score for tier RAM"
    )
    disk_threshold: float | None = Field(
        None, gt=0.0, le=1.0, description="advisor score for tier DISK"
    )
    auto_promote: bool = Field(
        False,
        description="the system trigger may ask the gate for the durable tiers when the disk rule "
                    "holds",
    )
    credentials: CredentialConfig | None = Field(
        None,
        description="credential verification; none = no verified authority, nothing is durable",
    )
    revocation_db: Path | None = Field(None, description="SQLite revocation list")
    label_catalog: Path | None = Field(None, description="SQLite source-label catalog")
    label_catalog_json: Path | None = Field(
        None, description="JSON labels imported into label_catalog at start"
    )
    durable_region: str | None = Field(
        None, min_length=1, description="residency region of LMCache's gated durable tiers")
    max_params_bytes: int = Field(
        65536, ge=1024, description="size limit of a request's kvci params"
    )

    @model_validator(mode="after")
    def _check(self) -> KVCILMCacheConfig:
        if self.revocation_db is not None and self.credentials is None:
            raise ValueError("revocation_db needs credentials")
        if self.label_catalog_json is not None and self.label_catalog is None:
            raise ValueError(
                "label_catalog_json needs label_catalog (the catalog it is imported into)"
            )
        if (self.ram_threshold is not None and self.disk_threshold is not None
                and self.ram_threshold > self.disk_threshold):
            raise ValueError("ram_threshold cannot exceed disk_threshold")
        return self

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> KVCILMCacheConfig:
        """Validate `kv_connector_extra_config["kvci"]`; errors name the offending key."""
        raw = (extra or {}).get(EXTRA_CONFIG_KEY, {})
        if not isinstance(raw, dict):
            raise TypeError(f"kv_connector_extra_config.{EXTRA_CONFIG_KEY} must be an object, "
                            f"got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(
                f"invalid kv_connector_extra_config.{EXTRA_CONFIG_KEY}: {exc}"
            ) from None
