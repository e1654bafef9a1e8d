"""model_self_report: the model's own flag, evidence and never authority."""

from __future__ import annotations

from kvci_plugin.worthiness.observation import CheckpointObservation
from kvci_plugin.worthiness.scorers.memo import memoised
from kvci_plugin.worthiness.signal import CheckpointSignal, SignalKind

MODEL_SELF_REPORT = "model_self_report"


class ModelSelfReportScorer:
    """Value = 0.5 + 0.5 * confidence when the model reports understanding, 0.5 - 0.5 * confidence
    when it reports it has not (confidence defaults to 1); abstains without a report.

    The smallest default weight; the advisor also refuses to recommend on this signal alone.
    """

    name = MODEL_SELF_REPORT
    weight = 0.05

    def score(self, observation: CheckpointObservation) -> CheckpointSignal:
        report = observation.self_report
        if report is None:
            return _signal(None, None)
        return _signal(report.understood, report.confidence)


@memoised
def _signal(understood: bool | None, confidence: float | None) -> CheckpointSignal:
    if understood is None:
        return CheckpointSignal(
            name=MODEL_SELF_REPORT, kind=SignalKind.OPPORTUNITY, value=None, reason="no self-report"
        )
    confidence = 1.0 if confidence is None else confidence
    if understood:
        value, claim = 0.5 + 0.5 * confidence, "reports a strong working understanding"
    else:
        value, claim = 0.5 - 0.5 * confidence, "reports no working understanding yet"
    return CheckpointSignal(
        name=MODEL_SELF_REPORT,
        kind=SignalKind.OPPORTUNITY,
        value=value,
        reason=f"the model {claim} (confidence {confidence:.2f})",
    )
