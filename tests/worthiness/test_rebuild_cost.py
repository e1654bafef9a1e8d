from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.worthiness import CheckpointObservation, RebuildCostModel
from kvci_plugin.worthiness.rebuild_cost import HALF_COST_SECONDS, PREFILL_TOKENS_PER_SECOND
from kvci_plugin.worthiness.scorers import RebuildCostScorer

MODEL = RebuildCostModel()


def test_unmeasured_context_is_not_known_and_the_scorer_abstains() -> None:
    estimate = MODEL.estimate(tool_calls=5, retrievals=2)
    assert not estimate.known
    assert estimate.value is None
    assert estimate.unmeasured == ("tokens", "wall_time_s")
    assert RebuildCostScorer().score(CheckpointObservation(tool_calls=5)).value is None


def test_measured_zero_is_known_and_free() -> None:
    estimate = MODEL.estimate(tokens=0, tool_calls=0, retrievals=0, wall_time_s=0.0)
    assert estimate.known
    assert estimate.value == 0.0
    assert estimate.unmeasured == ()


def test_the_half_point_is_the_documented_context_size() -> None:
    # The 0.5 point sits at HALF_COST_SECONDS of prefill: 8192 tokens with the defaults.
    assert PREFILL_TOKENS_PER_SECOND * HALF_COST_SECONDS == 8192
    assert MODEL.estimate(tokens=8192).value == pytest.approx(0.5)
    assert MODEL.estimate(wall_time_s=HALF_COST_SECONDS).value == pytest.approx(0.5)


def test_wall_time_and_work_are_lower_bounds_and_the_larger_one_wins() -> None:
    assert MODEL.estimate(tokens=8192, wall_time_s=3.0).seconds == pytest.approx(3.0)
    # 16384 tokens (2 s) + 2 tool calls (2 s) + 2 retrievals (1 s) outweigh 0.5 s of wall time.
    assert MODEL.estimate(
        tokens=16384, tool_calls=2, retrievals=2, wall_time_s=0.5
    ).seconds == pytest.approx(5.0)


def test_observation_tokens_include_output_tokens() -> None:
    estimate = MODEL.estimate_observation(
        CheckpointObservation(context_tokens=4096, output_tokens=4096)
    )
    assert estimate.tokens == 8192
    assert estimate.value == pytest.approx(0.5)


def test_the_scorer_reads_the_shared_estimator() -> None:
    slow_hardware = RebuildCostModel(prefill_tokens_per_second=1024.0)
    observation = CheckpointObservation(context_tokens=1024, tool_calls=0)
    signal = RebuildCostScorer(slow_hardware).score(observation)
    assert (
        signal.value == slow_hardware.estimate_observation(observation).value == pytest.approx(0.5)
    )
    assert (
        RebuildCostScorer().score(observation).value
        == MODEL.estimate_observation(observation).value
    )
    assert "retrievals" in signal.reason  # the unmeasured inputs are named, not read as zero


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tokens": -1}, ValueError, "tokens"),
        ({"tool_calls": 1.5}, TypeError, "tool_calls"),
        ({"retrievals": True}, TypeError, "retrievals"),
        ({"wall_time_s": math.nan}, ValueError, "wall_time_s"),
        ({"wall_time_s": "1"}, TypeError, "wall_time_s"),
    ],
)
def test_direct_callers_get_clear_errors(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        MODEL.estimate(**kwargs)  # type: ignore[arg-type]


def test_model_constants_are_validated() -> None:
    with pytest.raises(ValueError, match="prefill_tokens_per_second"):
        RebuildCostModel(prefill_tokens_per_second=0.0)
    with pytest.raises(ValueError, match="half_cost_seconds"):
        RebuildCostModel(half_cost_seconds=math.inf)


optional_count = st.one_of(st.none(), st.integers(0, 10**6))


@settings(max_examples=150, deadline=None)
@given(
    tokens=optional_count,
    tool_calls=optional_count,
    retrievals=optional_count,
    wall=st.one_of(st.none(), st.floats(0.0, 1e5)),
    field=st.sampled_from(["tokens", "tool_calls", "retrievals", "wall_time_s"]),
    increase=st.integers(1, 10**5),
)
def test_the_estimate_never_falls_when_an_input_grows(
    tokens: int | None,
    tool_calls: int | None,
    retrievals: int | None,
    wall: float | None,
    field: str,
    increase: int,
) -> None:
    inputs: dict[str, float | int | None] = {
        "tokens": tokens,
        "tool_calls": tool_calls,
        "retrievals": retrievals,
        "wall_time_s": wall,
    }
    before = MODEL.estimate(**inputs)  # type: ignore[arg-type]
    if inputs[field] is None:
        return
    inputs[field] = inputs[field] + increase  # type: ignore[operator]
    after = MODEL.estimate(**inputs)  # type: ignore[arg-type]
    if before.known:
        assert after.value is not None and before.value is not None
        assert 0.0 <= before.value <= after.value <= 1.0
