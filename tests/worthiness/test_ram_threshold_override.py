"""A per-call RAM threshold (the bar a tier-pressure rule moves) and what it held back."""

from __future__ import annotations

import pytest

from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointTier,
    ModelSelfReport,
)

from .fixed_scorers import FixedScorer, registry_of

OBS = CheckpointObservation()


def advisor_scoring(value: float, *, veto: bool = False) -> CheckpointAdvisor:
    return CheckpointAdvisor(registry_of(FixedScorer("evidence", 1.0, value, veto=veto)))


def test_a_per_call_threshold_replaces_the_advisors_own_for_that_call_only() -> None:
    advisor = advisor_scoring(0.5)
    held = advisor.recommend(OBS)
    assert held.tier is CheckpointTier.NONE and held.ram_threshold == 0.55
    assert held.held_back_by_threshold
    assert any("below the ram threshold 0.55" in blocker for blocker in held.blockers)

    lowered = advisor.recommend(OBS, ram_threshold=0.45)
    assert lowered.tier is CheckpointTier.RAM and lowered.ram_threshold == 0.45
    assert not lowered.held_back_by_threshold
    assert not any("ram not recommended" in blocker for blocker in lowered.blockers)

    raised = advisor_scoring(0.6).recommend(OBS, ram_threshold=0.7)
    assert raised.tier is CheckpointTier.NONE and raised.held_back_by_threshold
    assert advisor.recommend(OBS).ram_threshold == advisor.ram_threshold == 0.55


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0.0, ValueError),
        (0.76, ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("0.5", TypeError),
    ],
)
def test_a_per_call_threshold_outside_zero_to_the_disk_threshold_is_refused(
    value: object, error: type
) -> None:
    with pytest.raises(error, match="ram_threshold"):
        advisor_scoring(0.5).recommend(OBS, ram_threshold=value)  # type: ignore[arg-type]


def test_no_bar_lifts_a_veto_or_an_empty_or_self_report_only_recommendation() -> None:
    vetoed = advisor_scoring(0.1, veto=True).recommend(OBS, ram_threshold=0.05)
    assert vetoed.tier is CheckpointTier.NONE and not vetoed.held_back_by_threshold

    silent = advisor_scoring(0.5)
    silent.registry.replace(FixedScorer("evidence", 1.0, None))
    empty = silent.recommend(OBS, ram_threshold=0.05)
    assert empty.score is None and not empty.held_back_by_threshold

    self_report = CheckpointAdvisor().recommend(
        CheckpointObservation(self_report=ModelSelfReport(understood=False)), ram_threshold=0.05
    )
    assert self_report.tier is CheckpointTier.NONE and not self_report.held_back_by_threshold
