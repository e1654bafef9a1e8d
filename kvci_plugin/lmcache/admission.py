"""The save decision for one request, taken when the scheduler first looks at it.

LMCache stores a request's chunks while the request runs (after each prefill step), not when it
finishes, so the decision must exist before the first step: at that moment the engine has
measured nothing but the prompt. The observation is the client's `kvci` fields plus the prompt
length as `context_tokens`; output tokens, prefill time and cache hits are unknown (None), so
the scorers that read them abstain. kvci's own connector decides at the end of the request,
with those measurements; this one cannot. Both ask the same ``KeepDecider`` (the trigger and
the durable-copy wish are decided there), this one with nothing measured.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from kvci_plugin.governance import (
    EligibilityDecision,
    PersistenceRequest,
    Trigger,
    get_persistence_eligibility_gate,
)
from kvci_plugin.lmcache.config import KVCILMCacheConfig
from kvci_plugin.lmcache.decision import SaveDecision
from kvci_plugin.lmcache.gated_tiers import GatedTiers
from kvci_plugin.lmcache.request_configs import SKIP_SAVE, client_skips_save
from kvci_plugin.policy import FinishedRequest, KeepDecider, KeepPlan, ram_policy_for
from kvci_plugin.request.params import KVCIRequestParams, ParamsError, parse_request_params
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.worthiness import (
    CheckpointAdvisor,
    CheckpointObservation,
    CheckpointRecommendation,
)


class AdmissionPolicy:
    def __init__(
        self, config: KVCILMCacheConfig, tenants: TenantResolver, tiers: GatedTiers
    ) -> None:
        self.config = config
        self.tenants = tenants
        self.tiers = tiers
        thresholds: dict[str, float] = {}
        if config.ram_threshold is not None:
            thresholds["ram_threshold"] = config.ram_threshold
        if config.disk_threshold is not None:
            thresholds["disk_threshold"] = config.disk_threshold
        self.advisor = CheckpointAdvisor(**thresholds)
        # kvci's own keep decision; LMCache keeps what clears the worthiness bar (its own tiers
        # evict), and no cache gate or armed checkpoint reaches a decision taken when the
        # scheduler first sees the request.
        self.decider = KeepDecider(
            ram=ram_policy_for("threshold"),
            advisor=self.advisor,
            system_trigger=config.system_trigger,
            auto_promote=config.auto_promote,
        )

    def decide(self, request_id: str, kv_transfer_params: Any, prompt_tokens: int) -> SaveDecision:
        """Never raises for bad client input: a rejected request saves nothing and says why."""
        try:
            params = parse_request_params(kv_transfer_params, self.config.max_params_bytes)
            tenant = self.tenants.resolve(params)
        except ParamsError as exc:
            return _refused(self.tenants.default, str(exc))
        try:
            observation = _observation(params, prompt_tokens)
        except (ValueError, TypeError) as exc:
            return _refused(tenant, f"invalid observation: {exc}")
        plan = self.decider.decide(_admitted(tenant, params, observation))
        rec, trigger = plan.recommendation, cast(Trigger | None, plan.trigger)
        reasons = [
            f"decided at admission from the prompt ({prompt_tokens} tokens) and the client's kvci "
            "fields; the output, prefill time and cache hits are not known yet",
            _describe(rec),
            self._trigger_reason(plan, params),
        ]
        save = trigger is not None
        if save and params is not None and params.opted_out:
            save = False
            reasons.append("the client asked for checkpoint 'never': LMCache saves nothing")
        if save and client_skips_save(kv_transfer_params):
            save = False
            reasons.append(f"the client set {SKIP_SAVE}: LMCache saves nothing")
        if trigger is None or not save or not plan.persist:
            reasons.append("durable tiers: " + ("not requested" if save else "nothing is saved"))
            return SaveDecision(
                tenant=tenant,
                save=save,
                durable=False,
                trigger=trigger,
                reasons=tuple(reasons),
                recommendation=rec,
                client_asked=params is not None,
            )
        persist = get_persistence_eligibility_gate().evaluate(PersistenceRequest(
            checkpoint_id=f"lmcache:{request_id}", tenant=tenant, trigger=trigger,
            session_token=plan.session_token, delegation_tokens=plan.delegation_tokens,
            source_ids=tuple(params.source_ids) if params else (),
            durable_store_region=self.config.durable_region))
        durable = self._durable(persist, reasons)
        return SaveDecision(
            tenant=tenant,
            save=True,
            durable=durable,
            retention_expiry=persist.retention_expiry if durable else None,
            trigger=trigger,
            reasons=tuple(reasons),
            recommendation=rec,
            persist=persist,
            client_asked=params is not None,
        )

    @staticmethod
    def _trigger_reason(plan: KeepPlan, params: KVCIRequestParams | None) -> str:
        """Who asks LMCache to save: the client explicitly, or the system on a worthy verdict."""
        if plan.trigger is not None and plan.trigger != "system":  # "user" or "agent"
            persist = params is not None and params.persist
            return f"explicit {plan.trigger} trigger: " + (
                "persist requested" if persist else "checkpoint=now"
            )
        if plan.trigger == "system":
            return "system trigger: the recommendation is worth keeping"
        if not plan.recommendation.worth_it:
            return "not worth keeping and no explicit trigger: LMCache saves nothing"
        return "worth keeping, but the system trigger is off (kvci.system_trigger=false)"

    def _durable(self, persist: EligibilityDecision, reasons: list[str]) -> bool:
        """Whether a gated durable tier will take the copy the gate decided on."""
        if not persist.permitted:
            reasons.append(f"durable tiers: {persist.reason}")
            return False
        until = _until(persist.retention_expiry)
        accepting = self.tiers.accepting(persist.retention_expiry)
        if accepting:
            reasons.append(f"durable tiers: permitted by gate {persist.gate!r} ({until}); "
                           f"gated tier(s) {', '.join(accepting)} may keep a copy")
        elif not self.tiers.any:
            reasons.append(
                f"durable tiers: permitted ({until}), but LMCache has no gated durable tier"
            )
        else:
            reasons.append(
                f"durable tiers: permitted ({until}), but the gated remote tier keeps only "
                "copies without a retention limit: kvci cannot delete a remote copy on time"
            )
        return bool(accepting)


def _admitted(
    tenant: str, params: KVCIRequestParams | None, observation: CheckpointObservation
) -> FinishedRequest:
    """The request as the keep decision reads it when the scheduler first sees it: nothing
    measured yet. A client's checkpoint 'never' is left out: LMCache's reply names the trigger it
    passed by, and says no to the save itself (as for skip_save)."""
    if params is None:
        return FinishedRequest(tenant=tenant, observation=observation)
    return FinishedRequest(
        tenant=tenant,
        observation=observation,
        explicit_trigger=params.explicit_trigger,
        persist=params.persist,
        session_token=params.session_token,
        delegation_tokens=tuple(params.delegation_tokens),
    )


def _observation(params: KVCIRequestParams | None, prompt_tokens: int) -> CheckpointObservation:
    observation = dict(params.observation or {}) if params is not None else {}
    if observation.get("context_tokens") is None:
        observation["context_tokens"] = prompt_tokens  # the client's own count wins, as at finish
    return CheckpointObservation.from_inputs(
        observation,
        params.evidence_bundle if params else None,
        params.context_bundle if params else None,
    )


def _describe(rec: CheckpointRecommendation) -> str:
    score = "no score" if rec.score is None else f"score {rec.score:.2f}"
    if rec.worth_it:
        return f"recommendation: tier {rec.tier.value} ({score})"
    return f"recommendation: not worth keeping ({score}): {'; '.join(rec.blockers)}"


def _until(retention_expiry: float | None) -> str:
    if retention_expiry is None:
        return "no retention limit"
    return "retain until " + datetime.fromtimestamp(retention_expiry, tz=timezone.utc).isoformat(
        timespec="seconds"
    )


def _refused(tenant: str, error: str) -> SaveDecision:
    # Deny by default: what kvci could not judge, LMCache does not save.
    return SaveDecision(
        tenant=tenant,
        save=False,
        durable=False,
        error=error,
        reasons=(f"kvci params rejected, LMCache saves nothing: {error}",),
        client_asked=True,
    )
