from __future__ import annotations

import asyncio
import contextvars

import pytest

from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointRecommendation,
    CheckpointSignal,
    CheckpointTier,
    ModelSelfReport,
    SignalKind,
    current_recommendation,
    default_registry,
    publish_recommendation,
    render_advisory,
    reset_recommendation,
)

ADVISOR = CheckpointAdvisor()
RAM_WORTHY = CheckpointObservation(
    context_tokens=40_000,
    sibling_tasks=2,
    self_report=ModelSelfReport(understood=True),
    turns_since_change=1,
)


def test_nothing_published_renders_nothing() -> None:
    # Each test runs in a context where nothing was published.
    assert contextvars.copy_context().run(render_advisory) == ""
    assert contextvars.copy_context().run(current_recommendation) is None


def test_a_not_worth_it_verdict_renders_nothing() -> None:
    not_worth_it = ADVISOR.recommend(CheckpointObservation(context_tokens=100))
    assert not_worth_it.tier is CheckpointTier.NONE and not_worth_it.score is not None
    assert render_advisory(not_worth_it) == ""
    vetoed = ADVISOR.recommend(
        RAM_WORTHY.model_copy(
            update={"contradictions_unresolved": 1, "contradictions_high_severity": 1}
        )
    )
    assert render_advisory(vetoed) == ""


def test_the_block_has_the_seeds_shape() -> None:
    recommendation = ADVISOR.recommend(RAM_WORTHY)
    assert recommendation.tier is CheckpointTier.RAM
    text = render_advisory(recommendation)
    lines = text.splitlines()
    assert lines[0] == (
        "KV-CHECKPOINT ADVISORY (from the system's checkpoint-worthiness scorers — advisory only, "
        "you decide):"
    )
    assert (
        lines[1] == f"checkpoint-worthy: score {recommendation.score:.2f} (recommended tier: ram)"
    )
    assert lines[2].startswith("  drivers: rebuild_cost=0.83 (rebuild >= 4.88 s from 40000 tokens;")
    assert "predicted_reuse=0.50 (2 related tasks would reuse this context)" in lines[2]
    assert lines[3].startswith(
        "  blockers: disk not recommended — context_stability 0.33 below 0.60"
    )
    assert (
        lines[4]
        == "  no evidence from: retrieval_saturation, grounding_density, contradictions, "
           "phase_boundary"
    )
    assert lines[5].startswith(
        "If you judge this context worth preserving, call graph_kv_checkpoint with "
        "action='checkpoint_now'"
    )
    assert len(lines) == 6


def test_a_failed_scorer_is_named_in_the_block() -> None:
    class Broken:
        name = "broken"
        weight = 0.1

        def score(self, observation: CheckpointObservation) -> CheckpointSignal:
            raise KeyError("missing")

    registry = default_registry()
    registry.register(Broken())
    text = render_advisory(CheckpointAdvisor(registry).recommend(RAM_WORTHY))
    assert "  scorers that failed: broken (KeyError)" in text.splitlines()


def test_reasons_stay_on_one_line() -> None:
    class Chatty:
        name = "chatty"
        weight = 1.0

        def score(self, observation: CheckpointObservation) -> CheckpointSignal:
            return CheckpointSignal(
                name="chatty", kind=SignalKind.OPPORTUNITY, value=1.0, reason="line one\nline two"
            )

    registry = default_registry()
    registry.register(Chatty())
    text = render_advisory(CheckpointAdvisor(registry).recommend(RAM_WORTHY))
    assert "chatty=1.00 (line one line two)" in text
    assert all(not line.startswith("line two") for line in text.splitlines())


def test_render_without_an_argument_reads_the_published_verdict() -> None:
    recommendation = ADVISOR.recommend(RAM_WORTHY)

    def in_a_run() -> tuple[str, str]:
        token = publish_recommendation(recommendation)
        published = render_advisory()
        reset_recommendation(token)
        return published, render_advisory()

    published, after_reset = contextvars.copy_context().run(in_a_run)
    assert published == render_advisory(recommendation) != ""
    assert after_reset == ""


def test_publish_refuses_what_is_not_a_recommendation() -> None:
    with pytest.raises(TypeError, match="CheckpointRecommendation"):
        publish_recommendation({"tier": "ram"})  # type: ignore[arg-type]


def test_interleaved_tasks_never_read_each_others_verdict() -> None:
    worthy = ADVISOR.recommend(RAM_WORTHY)
    unworthy = ADVISOR.recommend(CheckpointObservation(context_tokens=10))

    async def run(
        mine: CheckpointRecommendation, published: asyncio.Event, other_published: asyncio.Event
    ) -> tuple[CheckpointRecommendation | None, str]:
        publish_recommendation(mine)
        published.set()
        await other_published.wait()  # the other task has published its own verdict by now
        await asyncio.sleep(0)
        return current_recommendation(), render_advisory()

    async def main() -> list[tuple[CheckpointRecommendation | None, str]]:
        first, second = asyncio.Event(), asyncio.Event()
        return list(await asyncio.gather(run(worthy, first, second), run(unworthy, second, first)))

    (seen_by_first, text_first), (seen_by_second, text_second) = asyncio.run(main())
    assert seen_by_first is worthy and text_first == render_advisory(worthy) != ""
    assert seen_by_second is unworthy and text_second == ""


def test_the_published_verdict_round_trips_and_renders_identically() -> None:
    recommendation = ADVISOR.recommend(RAM_WORTHY)
    restored = CheckpointRecommendation.model_validate_json(recommendation.model_dump_json())
    assert render_advisory(restored) == render_advisory(recommendation)
