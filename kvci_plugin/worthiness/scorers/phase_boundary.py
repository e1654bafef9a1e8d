"""phase_boundary: a finished understand/plan phase is a natural seam."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

PHASE_BOUNDARY = "phase_boundary"

# Phases whose end leaves a context the following work builds on (compared case-insensitively).
SEAM_PHASES = frozenset({"understand", "plan"})
# A completed seam phase is the best moment; another completed phase is still a boundary, but
# what follows may not build on it; mid-phase the context is still being assembled.
COMPLETED_SEAM_VALUE = 1.0
COMPLETED_OTHER_VALUE = 0.7
IN_PROGRESS_VALUE = 0.2


class PhaseBoundaryScorer:
    """Value = COMPLETED_SEAM / COMPLETED_OTHER / IN_PROGRESS; completing a phase never lowers it.

    Abstains when phase_completed was not measured.
    """

    name = PHASE_BOUNDARY
    weight = 0.10

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        return _signal(observation.phase, observation.phase_completed)


@memoised
def _signal(phase: str | None, completed: bool | None) -> CheckpointSignal:
    if completed is None:
        return CheckpointSignal(
            name=PHASE_BOUNDARY,
            kind=SignalKind.OPPORTUNITY,
            value=None,
            reason="phase completion not measured",
        )
    label = phase if phase is not None else "unnamed"
    if not completed:
        value, reason = IN_PROGRESS_VALUE, f"phase {label!r} in progress"
    elif phase is not None and phase.lower() in SEAM_PHASES:
        value, reason = COMPLETED_SEAM_VALUE, f"phase {label!r} completed"
    else:
        value, reason = COMPLETED_OTHER_VALUE, f"phase {label!r} completed (not a seam phase)"
    return CheckpointSignal(
        name=PHASE_BOUNDARY, kind=SignalKind.OPPORTUNITY, value=value, reason=reason
    )
