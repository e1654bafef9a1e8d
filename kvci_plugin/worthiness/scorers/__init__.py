"""The default signal set, one scorer per module with its constants."""

from __future__ import annotations

from kvci_plugin.worthiness.scorers.context_stability import (
    CONTEXT_STABILITY,
    ContextStabilityScorer,
)
from kvci_plugin.worthiness.scorers.contradictions import CONTRADICTIONS, ContradictionsScorer
from kvci_plugin.worthiness.scorers.grounding_density import (
    GROUNDING_DENSITY,
    GroundingDensityScorer,
)
from kvci_plugin.worthiness.scorers.model_self_report import (
    MODEL_SELF_REPORT,
    ModelSelfReportScorer,
)
from kvci_plugin.worthiness.scorers.phase_boundary import PHASE_BOUNDARY, PhaseBoundaryScorer
from kvci_plugin.worthiness.scorers.predicted_reuse import PREDICTED_REUSE, PredictedReuseScorer
from kvci_plugin.worthiness.scorers.rebuild_cost import REBUILD_COST, RebuildCostScorer
from kvci_plugin.worthiness.scorers.retrieval_saturation import (
    RETRIEVAL_SATURATION,
    RetrievalSaturationScorer,
)

__all__ = [
    "CONTEXT_STABILITY",
    "CONTRADICTIONS",
    "GROUNDING_DENSITY",
    "MODEL_SELF_REPORT",
    "PHASE_BOUNDARY",
    "PREDICTED_REUSE",
    "REBUILD_COST",
    "RETRIEVAL_SATURATION",
    "ContextStabilityScorer",
    "ContradictionsScorer",
    "GroundingDensityScorer",
    "ModelSelfReportScorer",
    "PhaseBoundaryScorer",
    "PredictedReuseScorer",
    "RebuildCostScorer",
    "RetrievalSaturationScorer",
]
