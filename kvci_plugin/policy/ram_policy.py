"""The ``ram_policy`` setting, resolved once: what each name means for the keep decision.

``value`` (the default) and ``lru`` let the tier policy weigh every offer the worthiness rules
allow (``system_may_offer``); ``threshold`` keeps only what clears the worthiness bar, evicts by
LRU, and may move its bar with the tier's pressure (``PressureAwareAdmission``). Everything that
differs by name is answered here, so no caller compares the name itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

from kvci_plugin.policy.lru_policy import LRUPolicy
from kvci_plugin.policy.offer import default_hit_rate_floor, system_may_offer
from kvci_plugin.policy.reuse_hazard import ReuseHazard
from kvci_plugin.policy.tier_policy import TierPolicy
from kvci_plugin.policy.value_policy import ValuePolicy
from kvci_plugin.worthiness import CheckpointRecommendation

RAMPolicyName = Literal["value", "lru", "threshold"]
RAM_POLICY_NAMES: tuple[str, ...] = get_args(RAMPolicyName)


@dataclass(frozen=True, slots=True)
class RAMPolicy:
    """One ``ram_policy``: how the system trigger offers, which tier policy evicts, and the
    cache gate's default hit-rate floor."""

    name: RAMPolicyName
    # The system trigger keeps only what clears the worthiness bar (the bar is the admission
    # rule, so it is the bar that may follow the tier's pressure).
    under_bar: bool

    def system_offers(self, rec: CheckpointRecommendation) -> bool:
        """Whether the system trigger offers this request to the RAM tier: under the bar only
        what clears it; under a policy that weighs offers, whatever the worthiness rules allow."""
        return rec.worth_it if self.under_bar else system_may_offer(rec)

    @property
    def hit_rate_floor(self) -> float:
        """The cache gate's floor when none is configured (``default_hit_rate_floor``)."""
        return default_hit_rate_floor(self.name)

    def tier_policy(self, learned: ReuseHazard | None = None) -> TierPolicy:
        """The RAM index's policy; ``learned``: what a ``value`` policy learned before a restart."""
        return ValuePolicy(hazard=learned) if self.name == "value" else LRUPolicy()


def ram_policy_for(name: str) -> RAMPolicy:
    """The policy a ``ram_policy`` setting names; ValueError for any other name."""
    if name not in RAM_POLICY_NAMES:
        raise ValueError(f"ram_policy must be one of {', '.join(RAM_POLICY_NAMES)}, not {name!r}")
    return RAMPolicy(name=cast(RAMPolicyName, name), under_bar=name == "threshold")
