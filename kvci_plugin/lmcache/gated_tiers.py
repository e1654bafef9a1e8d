"""Which of kvci's gated durable tiers an LMCache deployment has configured."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatedTiers:
    # GatedLocalDiskBackend: kvci expires its copies, so any permitted retention is kept.
    local_disk: bool = False
    # GatedRemoteBackend: kvci cannot delete a remote copy on time, so only a permit without a
    # retention limit is written there.
    remote: bool = False

    @property
    def any(self) -> bool:
        return self.local_disk or self.remote

    def accepting(self, retention_expiry: float | None) -> tuple[str, ...]:
        """The tiers that take a copy permitted until `retention_expiry` (None = no limit)."""
        tiers = []
        if self.local_disk:
            tiers.append("local_disk")
        if self.remote and retention_expiry is None:
            tiers.append("remote")
        return tuple(tiers)
