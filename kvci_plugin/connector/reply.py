"""What a finished request is told: the `kvci` object of its response's kv_transfer_params.

The reply carries the recommendation and its advisory, what was kept (tier, checkpoint id,
persist, retention), the request's own hit, and the cache gate's decision without the
engine-wide figures (the hit-rate window is every tenant's lookups). A request that named its
session has its reply published for the control surface's `advisory` action.
"""

from __future__ import annotations

from typing import Any

from kvci_plugin.connector.request_state import RequestState
from kvci_plugin.connector.retain import retain_reply
from kvci_plugin.connector.tally import StatsTally
from kvci_plugin.policy import KeepPlan
from kvci_plugin.tiering.outcomes import CheckpointOutcome
from kvci_plugin.worthiness import PublishedVerdicts, render_advisory, retain_advice
from kvci_plugin.worthiness.cache_gate import ENGINE_WIDE_INPUTS

FAILED = ("kvci failed to decide for this request (a contained fault; the output is "
          "unaffected)")


def gate_reply(gate: Any, offered_prefix_tokens: int | None) -> dict[str, Any] | None:
    """The cache gate's decision as the reply shows it; a churn pause that still offered the prefix
    the session's rewrites kept says how many tokens of it."""
    if gate is None:
        return None
    reply = gate.model_dump(mode="json")
    # The hit-rate window is every tenant's lookups: a reply tells its caller none of it.
    for inputs in (reply["inputs"], *(e["inputs"] for e in reply["evaluated"])):
        for name in ENGINE_WIDE_INPUTS:
            inputs.pop(name, None)
    if offered_prefix_tokens is not None:
        reply["offered_prefix_tokens"] = offered_prefix_tokens
    return reply


def compose_reply(st: RequestState, plan: KeepPlan, outcome: CheckpointOutcome | None, *,
                  max_retain_s: float, block_size: int, stats: StatsTally) -> dict[str, Any]:
    """The `kvci` object of the response's kv_transfer_params."""
    rec = plan.recommendation
    advice = None if st.retain is not None else retain_advice(
        plan.observation, max_retain_s=max_retain_s)
    reply: dict[str, Any] = {
        "recommendation": rec.model_dump(mode="json"),
        "advisory": "\n".join(t for t in (render_advisory(rec), advice) if t),
        "retain_advice": advice,
        "retain": retain_reply(st.retain, outcome, stats),
        # Whether the turn ended on a tool call (the client's word, else the engine's from its
        # output ids; None: not known), and what was retained for the tool's pause when neither
        # the client nor its KV hints ordered a retention.
        "tool_call": plan.observation.tool_call_pending,
        "auto_retain": ({**outcome.retain.model_dump(mode="json"), "by": "engine"}
                        if st.retain is None and outcome and outcome.retain is not None
                        else None),
        "trigger": plan.trigger,
        "tier": outcome.tier if outcome else "none",
        "checkpoint_id": outcome.checkpoint_id if outcome else None,
        "hit_tokens": st.ext_tokens,
        "hit_tier": st.hit_tier.value if st.ext_tokens and st.hit_tier else None,
        "cache_gate": gate_reply(
            plan.gate, plan.blocks * block_size if plan.churn_keep else None),
        "persist": (outcome.persist.model_dump(mode="json")
                    if outcome and outcome.persist else None),
    }
    if outcome is not None and outcome.tier == "none":
        reply["not_kept"] = outcome.reason
    elif plan.opted_out:
        reply["not_kept"] = "the client asked for checkpoint 'never'"
    return reply


def publish(verdicts: PublishedVerdicts, st: RequestState, reply: dict[str, Any]) -> dict[str, Any]:
    """Keep the reply of a request that named its session, for the `advisory` action."""
    if st.session_id is not None:
        # A token reaching here verified: a refused one fails the params, and nothing is published.
        verdicts.publish(st.tenant, st.session_id, reply,
                         verified=st.params is not None and st.params.session_token is not None)
    return reply


def failure_reply(request: Any) -> dict[str, Any] | None:
    """A contained failure's reply: said only to a request that asked kvci something."""
    params = getattr(request, "kv_transfer_params", None)
    return {"kvci": {"error": FAILED}} if isinstance(params, dict) and "kvci" in params else None
