"""The connector's side of `kvci.retain`: the bound a request may ask for, the reply it gets, and
the figures `/metrics` shows. The retentions themselves live with the RAM tier
(`kvci_plugin.tiering.ram.retention`)."""

from __future__ import annotations

from typing import Any

from kvci_plugin.connector.tally import StatsTally
from kvci_plugin.request.params import KVCIRequestParams, ParamsError
from kvci_plugin.tiering.outcomes import CheckpointOutcome, RetainAsk
from kvci_plugin.tiering.ram.retention import RetentionStats


def retain_ask(params: KVCIRequestParams | None, max_retain_s: float) -> RetainAsk | None:
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
    return RetainAsk(ttl_s, params.session_id)


def retain_reply(ask: RetainAsk | None, outcome: CheckpointOutcome | None,
                 stats: StatsTally) -> dict[str, Any] | None:
    """The reply's `retain`: retained, or refused and why (the request is served either way)."""
    if ask is None:
        return None
    if outcome is not None and outcome.retain is not None:
        stats.count(f"retentions_{outcome.retain.status}")
        return outcome.retain.model_dump(mode="json")
    stats.count("retentions_refused")
    reason = outcome.reason if outcome is not None else "this request's KV is not kept"
    return {"status": "refused", "ttl_s": ask.ttl_s, "reason": f"kvci.retain refused: {reason}"}


def report_retentions(last: RetentionStats, now: RetentionStats, stats: StatsTally) -> None:
    """Retained bytes (a gauge) and the retentions ended since ``last``."""
    if now.retained_bytes != last.retained_bytes:
        stats.gauge("ram_retained_bytes", now.retained_bytes)
    if now.expired > last.expired:
        stats.count("retentions_expired", now.expired - last.expired)
    if now.released > last.released:
        stats.count("retentions_released", now.released - last.released)
