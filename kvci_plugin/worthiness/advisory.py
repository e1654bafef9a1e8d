"""How a recommendation reaches the model: published per run, rendered as an advisory block.

The verdict lives in a ContextVar, so two interleaved runs (asyncio tasks, threads) never read
each other's. Nothing published, or a "not worth it" verdict, renders the empty string: a run
that never engages this layer sends a byte-identical prompt, and telling a model "not a good
moment" every turn is noise that teaches it to ignore the channel.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

from kvci_plugin.worthiness.recommendation import CheckpointRecommendation

_current: ContextVar[CheckpointRecommendation | None] = ContextVar(
    "kvci_checkpoint_recommendation", default=None
)

ADVISORY_HEADER = (
    "KV-CHECKPOINT ADVISORY (from the system's checkpoint-worthiness scorers — advisory only, "
    "you decide):"
)
ADVISORY_ACTION = (
    "If you judge this context worth preserving, call graph_kv_checkpoint with "
    "action='checkpoint_now' (or send kvci.checkpoint='now' with your next request); add "
    "persist=true to ask for a disk copy, which the eligibility gate still decides. Otherwise "
    "ignore this advisory."
)


def publish_recommendation(
    recommendation: CheckpointRecommendation | None,
) -> Token[CheckpointRecommendation | None]:
    """Make ``recommendation`` the current run's verdict; the token restores the previous one."""
    if recommendation is not None and not isinstance(recommendation, CheckpointRecommendation):
        raise TypeError(
            f"expected a CheckpointRecommendation or None, got {type(recommendation).__name__}"
        )
    return _current.set(recommendation)


def reset_recommendation(token: Token[CheckpointRecommendation | None]) -> None:
    _current.reset(token)


def current_recommendation() -> CheckpointRecommendation | None:
    return _current.get()


def render_advisory(recommendation: CheckpointRecommendation | None = None) -> str:
    """The advisory block for ``recommendation`` (default: the current one), or ``""``."""
    rec = recommendation if recommendation is not None else _current.get()
    if rec is None or not rec.worth_it or rec.score is None:
        return ""
    lines = [
        ADVISORY_HEADER,
        f"checkpoint-worthy: score {rec.score:.2f} (recommended tier: {rec.tier.value})",
    ]
    if rec.drivers:
        drivers = "; ".join(f"{d.name}={d.value:.2f} ({_one_line(d.reason)})" for d in rec.drivers)
        lines.append(f"  drivers: {drivers}")
    if rec.blockers:
        lines.append(f"  blockers: {'; '.join(_one_line(blocker) for blocker in rec.blockers)}")
    if rec.abstained:
        lines.append(f"  no evidence from: {', '.join(rec.abstained)}")
    if rec.scorer_errors:
        errors = ", ".join(f"{e.name} ({e.error_type})" for e in rec.scorer_errors)
        lines.append(f"  scorers that failed: {errors}")
    lines.append(ADVISORY_ACTION)
    return "\n".join(lines)


def _one_line(text: str) -> str:
    """Scorer reasons come from deployment code: keep each on one line of the block."""
    return " ".join(text.split())
