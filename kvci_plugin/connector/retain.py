"""The connector's side of `kvci.retain`: the bound a request may ask for, the reply it gets, and
the figures `/metrics` shows. The retentions themselves live with the RAM tier
(`kvci_plugin.tiering.ram.retention`).

Three words may ask one, in this order: the client's `kvci.retain` (in `kv_transfer_params`), a
`kvci.retain` action of vLLM's KV hints (`Request.kv_hints`, `kvci_plugin.request.retain_hint`)
and the engine's automatic retention of a turn that ended on a tool call (`KeepPlan.retain_s`).
The first that speaks is the request's order; each is carried out the same way, within the same
bounds (`max_retain_s`, the tenant's share of the RAM tier).
"""

from __future__ import annotations

from typing import Any, Literal

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.tally import StatsTally
from kvci_plugin.request.hints import KVHints
from kvci_plugin.request.params import KVCIRequestParams, ParamsError
from kvci_plugin.request.retain_hint import retain_hint
from kvci_plugin.request.session import RequestSession
from kvci_plugin.tiering.outcomes import CheckpointOutcome, RetainAsk
from kvci_plugin.tiering.ram.retention import RetentionOutcome, RetentionStats


def retain_ask(params: KVCIRequestParams | None, max_retain_s: float,
               session: RequestSession | None) -> RetainAsk | None:
    """The request's retention ask; ParamsError when its TTL is over the engine's bound."""
    if params is None or params.retain is None:
        return None
    ttl_s = params.retain.ttl_s
    if ttl_s > max_retain_s:
        raise ParamsError(
            f"kvci.retain.ttl_s is {ttl_s:g} s, over this engine's max_retain_s ({max_retain_s:g} "
            "s)"
            if max_retain_s
            else "kvci.retain: this engine grants no retention (max_retain_s is 0)"
        )
    session_id, session_by = _session(session)
    return RetainAsk(ttl_s, session_id, session_by=session_by)


def hint_ask(hints: KVHints | None, params: KVCIRequestParams | None, max_retain_s: float,
             session: RequestSession | None) -> tuple[RetainAsk | None, tuple[str, ...]]:
    """The retention the request's KV hints order, when its client asked none itself (the
    client's word wins; its checkpoint "never" too), and what was ignored, for a debug line. A
    TTL over ``max_retain_s`` is trimmed to it: a hint never fails a request."""
    hint, problems = retain_hint(hints)
    if hint is None:
        return None, problems
    ignored = (
        "the client's own kvci.retain wins" if params is not None and params.retain is not None
        else "the client asked checkpoint 'never'" if params is not None and params.opted_out
        else "this engine grants no retention (max_retain_s is 0)" if max_retain_s <= 0
        else None)
    if ignored is not None:
        return None, (*problems, f"kv_hints retention {hint.action_id!r} ignored: {ignored}")
    trimmed = hint.ttl_s > max_retain_s
    session_id, session_by = _session(session)
    return RetainAsk(
        min(hint.ttl_s, max_retain_s), session_id, word="kv_hints", priority=hint.priority,
        asked_ttl_s=hint.ttl_s if trimmed else None, session_by=session_by), problems


def _session(session: RequestSession | None) -> tuple[str | None, Literal["client", "vllm"]]:
    return (None, "client") if session is None else (session.session_id, session.by)


def retain_reply(ask: RetainAsk | None, outcome: CheckpointOutcome | None,
                 stats: StatsTally) -> dict[str, Any] | None:
    """The reply's `retain`: retained, or refused and why (the request is served either way),
    and by whose word (`by`: client or kv_hints)."""
    if ask is None:
        return None
    if outcome is not None and outcome.retain is not None:
        stats.count(f"retentions_{outcome.retain.status}")
        if ask.word == "kv_hints" and outcome.retain.status == "retained":
            stats.count(c.RETENTIONS_KV_HINTS)
        return ask.describe(outcome.retain)
    stats.count("retentions_refused")
    reason = outcome.reason if outcome is not None else "this request's KV is not kept"
    return ask.describe(RetentionOutcome(status="refused", ttl_s=ask.ttl_s,
                                         reason=f"kvci.retain refused: {reason}"))


def report_retentions(last: RetentionStats, now: RetentionStats, stats: StatsTally) -> None:
    """Retained bytes (a gauge) and the retentions ended since ``last``."""
    if now.retained_bytes != last.retained_bytes:
        stats.gauge("ram_retained_bytes", now.retained_bytes)
    if now.expired > last.expired:
        stats.count("retentions_expired", now.expired - last.expired)
    if now.released > last.released:
        stats.count("retentions_released", now.released - last.released)
