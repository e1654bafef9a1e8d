"""The gate for deployments that prohibit durable KV checkpoints outright; also the default."""

from __future__ import annotations

import time

from kvci_plugin.governance.decision import CheckRecord, EligibilityDecision, PersistenceDerivation
from kvci_plugin.governance.request import PersistenceRequest

_DETAIL = "this deployment prohibits durable KV checkpoints"


class AlwaysDenyEligibility:
    name = "always_deny"

    def evaluate(self, request: PersistenceRequest) -> EligibilityDecision:
        return EligibilityDecision(
            permitted=False,
            gate=self.name,
            checkpoint_id=request.checkpoint_id,
            trigger=request.trigger,
            failed_check=self.name,
            reason=f"refused at {self.name}: {_DETAIL}",
            derivation=PersistenceDerivation(
                checks=(CheckRecord(name=self.name, verdict="fail", detail=_DETAIL),)
            ),
            evaluated_at=time.time(),
        )
