"""What a tier keeps and evicts: one policy that the RAM index and the simulator both run."""

from kvci_plugin.policy.lru_policy import LRUPolicy
from kvci_plugin.policy.offer import Offer, default_hit_rate_floor, offer_for, offer_rebuild_s, system_may_offer
from kvci_plugin.policy.policy_state import PolicyStateFile, PolicyStateSaver
from kvci_plugin.policy.reuse_hazard import HazardCounts
from kvci_plugin.policy.tier_policy import PolicyStats, TierPolicy
from kvci_plugin.policy.value_policy import ValuePolicy

__all__ = ["HazardCounts", "LRUPolicy", "Offer", "PolicyStateFile", "PolicyStateSaver", "PolicyStats", "TierPolicy",
           "ValuePolicy", "default_hit_rate_floor", "offer_for", "offer_rebuild_s", "system_may_offer"]
