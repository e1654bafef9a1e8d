"""Checkpoint-worthiness scoring: is the KV cache a request built worth keeping, and where?

Pure Python + pydantic: this layer imports neither torch nor vllm. Scorers read a
``CheckpointObservation`` and return ``CheckpointSignal``s; the ``CheckpointAdvisor`` aggregates
the registered ones into a ``CheckpointRecommendation``; ``render_advisory`` turns the published
verdict into the block an agent reads; ``CacheGate`` decides whether the autonomous trigger may
act on it right now.
"""

from __future__ import annotations

from kvci_plugin.worthiness.advisor import DEFAULT_RAM_THRESHOLD, CheckpointAdvisor
from kvci_plugin.worthiness.advisory import (
    current_recommendation,
    publish_recommendation,
    render_advisory,
    reset_recommendation,
)
from kvci_plugin.worthiness.bundles import (
    BundleClaim,
    BundleContradiction,
    BundleItem,
    ContextBundle,
    EvidenceBundle,
    derive_observation_fields,
)
from kvci_plugin.worthiness.cache_gate import (
    CacheGate,
    CacheGateDecision,
    CacheGateRule,
    RuleEvaluation,
    churn_keeps,
)
from kvci_plugin.worthiness.disk_rule import DiskPromotionRule
from kvci_plugin.worthiness.observation import CheckpointObservation, ModelSelfReport
from kvci_plugin.worthiness.rebuild_cost import RebuildCostEstimate, RebuildCostModel
from kvci_plugin.worthiness.recommendation import (
    CheckpointRecommendation,
    CheckpointTier,
    Driver,
    ScorerError,
)
from kvci_plugin.worthiness.registry import (
    CheckpointScorerRegistry,
    RegisteredScorer,
    default_registry,
)
from kvci_plugin.worthiness.request_history import MAX_TRACKED, RequestHistory, SessionTurn
from kvci_plugin.worthiness.retain_advice import retain_advice
from kvci_plugin.worthiness.scorer import CheckpointScorer
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind
from kvci_plugin.worthiness.verdicts import PublishedVerdict, PublishedVerdicts

__all__ = [
    "DEFAULT_RAM_THRESHOLD",
    "MAX_TRACKED",
    "BundleClaim",
    "BundleContradiction",
    "BundleItem",
    "CacheGate",
    "CacheGateDecision",
    "CacheGateRule",
    "CheckpointAdvisor",
    "CheckpointObservation",
    "CheckpointRecommendation",
    "CheckpointScorer",
    "CheckpointScorerRegistry",
    "CheckpointSignal",
    "CheckpointTier",
    "ContextBundle",
    "DiskPromotionRule",
    "Driver",
    "EvidenceBundle",
    "ModelSelfReport",
    "PublishedVerdict",
    "PublishedVerdicts",
    "RebuildCostEstimate",
    "RebuildCostModel",
    "RegisteredScorer",
    "RequestHistory",
    "RuleEvaluation",
    "ScorerError",
    "SessionTurn",
    "SignalKind",
    "churn_keeps",
    "current_recommendation",
    "default_registry",
    "derive_observation_fields",
    "publish_recommendation",
    "render_advisory",
    "retain_advice",
    "reset_recommendation",
]
