"""The keep decision and what a tier keeps and evicts: one decider and one policy that the
scheduler, the RAM index, the simulator and the LMCache path all call."""

from kvci_plugin.policy.admission import AdmissionStats, PressureAwareAdmission
from kvci_plugin.policy.keep_decider import (
    ArmedCheckpoint,
    FinishedRequest,
    KeepDecider,
    KeepOutcome,
    KeepPlan,
    arm_binding,
    session_key,
)
from kvci_plugin.policy.lru_policy import LRUPolicy
from kvci_plugin.policy.offer import (
    Offer,
    default_hit_rate_floor,
    offer_for,
    offer_rebuild_s,
    system_may_offer,
)
from kvci_plugin.policy.policy_state import PolicyStateFile, PolicyStateSaver
from kvci_plugin.policy.ram_policy import RAM_POLICY_NAMES, RAMPolicy, ram_policy_for
from kvci_plugin.policy.return_gaps import Gap, ReturnGaps
from kvci_plugin.policy.reuse_hazard import HazardCounts
from kvci_plugin.policy.tier_policy import PolicyStats, TierPolicy
from kvci_plugin.policy.value_policy import ValuePolicy

__all__ = [
    "RAM_POLICY_NAMES",
    "AdmissionStats",
    "ArmedCheckpoint",
    "FinishedRequest",
    "Gap",
    "HazardCounts",
    "KeepDecider",
    "KeepOutcome",
    "KeepPlan",
    "LRUPolicy",
    "Offer",
    "PolicyStateFile",
    "PolicyStateSaver",
    "PolicyStats",
    "PressureAwareAdmission",
    "RAMPolicy",
    "ReturnGaps",
    "TierPolicy",
    "ValuePolicy",
    "arm_binding",
    "default_hit_rate_floor",
    "offer_for",
    "offer_rebuild_s",
    "ram_policy_for",
    "session_key",
    "system_may_offer",
]
