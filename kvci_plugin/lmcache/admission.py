"""The save decision for one request, taken when the scheduler first looks at it.

LMCache stores a request's chunks while the request runs (after each prefill step), not when it
finishes, so the decision must exist before the first step: at that moment the engine has
measured nothing but the prompt. The observation is the client's `kvci` fields plus the prompt
length as `context_tokens`; output tokens, prefill time and cache hits are unknown (None), so
the scorers that read them abstain. kvci's own connector decides at the end of the request,
with those measurements; this one cannot.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from kvci_plugin.connector.params import KVCIRequestParams, ParamsError, parse_request_params
from kvci_plugin.connector.tenancy import TenantResolver
from kvci_plugin.governance import EligibilityDecision, PersistenceRequest, Trigger, get_persistence_eligibility_gate
from kvci_plugin.lmcache.config import KVCILMCacheConfig
from kvci_plugin.lmcache.decision import SaveDecision
from kvci_plugin.lmcache.gated_tiers import GatedTiers
from kvci_plugin.lmcache.request_configs import SKIP_SAVE, client_skips_save
from kvci_plugin.worthiness import CheckpointAdvisor, CheckpointObservation, CheckpointRecommendation, CheckpointTier


class AdmissionPolicy:
    def __init__(self, config: KVCILMCacheConfig, tenants: TenantResolver, tiers: GatedTiers) -> None:
        self.config = config
        self.tenants = tenants
        self.tiers = tiers
        thresholds: dict[str, float] = {}
        if config.ram_threshold is not None:
            thresholds["ram_threshold"] = config.ram_threshold
        if config.disk_threshold is not None:
            thresholds["disk_threshold"] = config.disk_threshold
        self.advisor = CheckpointAdvisor(**thresholds)

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
        rec = self.advisor.recommend(observation)
        reasons = [
            f"decided at admission from the prompt ({prompt_tokens} tokens) and the client's kvci "
            "fields; the output, prefill time and cache hits are not known yet",
            _describe(rec),
        ]
        trigger = self._trigger(params, rec, reasons)
        save = trigger is not None
        if save and params is not None and params.opted_out:
            save = False
            reasons.append("the client asked for checkpoint 'never': LMCache saves nothing")
        if save and client_skips_save(kv_transfer_params):
            save = False
            reasons.append(f"the client set {SKIP_SAVE}: LMCache saves nothing")
        wants_durable = (params is not None and params.persist) or (
            trigger == "system" and self.config.auto_promote and rec.tier is CheckpointTier.DISK)
        if trigger is None or not save or not wants_durable:
            reasons.append("durable tiers: " + ("not requested" if save else "nothing is saved"))
            return SaveDecision(tenant=tenant, save=save, durable=False, trigger=trigger, reasons=tuple(reasons),
                                recommendation=rec, client_asked=params is not None)
        persist = get_persistence_eligibility_gate().evaluate(PersistenceRequest(
            checkpoint_id=f"lmcache:{request_id}", tenant=tenant, trigger=trigger,
            session_token=params.session_token if params else None,
            delegation_tokens=tuple(params.delegation_tokens) if params else (),
            source_ids=tuple(params.source_ids) if params else (),
            durable_store_region=self.config.durable_region))
        durable = self._durable(persist, reasons)
        return SaveDecision(
            tenant=tenant, save=True, durable=durable,
            retention_expiry=persist.retention_expiry if durable else None, trigger=trigger,
            reasons=tuple(reasons), recommendation=rec, persist=persist, client_asked=params is not None)

    def _trigger(self, params: KVCIRequestParams | None, rec: CheckpointRecommendation,
                 reasons: list[str]) -> Trigger | None:
        """Who asks LMCache to save: the client explicitly, or the system on a worthy verdict."""
        explicit = params.explicit_trigger if params is not None else None
        if params is not None and explicit is not None:
            reasons.append(f"explicit {explicit} trigger: " + ("persist requested" if params.persist
                                                               else "checkpoint=now"))
            return cast(Trigger, explicit)  # "user" or "agent" (KVCIRequestParams.trigger)
        if not rec.worth_it:
            reasons.append("not worth keeping and no explicit trigger: LMCache saves nothing")
            return None
        if not self.config.system_trigger:
            reasons.append("worth keeping, but the system trigger is off (kvci.system_trigger=false)")
            return None
        reasons.append("system trigger: the recommendation is worth keeping")
        return "system"

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
            reasons.append(f"durable tiers: permitted ({until}), but LMCache has no gated durable tier")
        else:
            reasons.append(f"durable tiers: permitted ({until}), but the gated remote tier keeps only "
                           "copies without a retention limit: kvci cannot delete a remote copy on time")
        return bool(accepting)


def _observation(params: KVCIRequestParams | None, prompt_tokens: int) -> CheckpointObservation:
    observation = dict(params.observation or {}) if params is not None else {}
    if observation.get("context_tokens") is None:
        observation["context_tokens"] = prompt_tokens  # the client's own count wins, as at finish
    return CheckpointObservation.from_inputs(
        observation, params.evidence_bundle if params else None, params.context_bundle if params else None)


def _describe(rec: CheckpointRecommendation) -> str:
    score = "no score" if rec.score is None else f"score {rec.score:.2f}"
    if rec.worth_it:
        return f"recommendation: tier {rec.tier.value} ({score})"
    return f"recommendation: not worth keeping ({score}): {'; '.join(rec.blockers)}"


def _until(retention_expiry: float | None) -> str:
    if retention_expiry is None:
        return "no retention limit"
    return "retain until " + datetime.fromtimestamp(retention_expiry, tz=timezone.utc).isoformat(timespec="seconds")


def _refused(tenant: str, error: str) -> SaveDecision:
    # Deny by default: what kvci could not judge, LMCache does not save.
    return SaveDecision(tenant=tenant, save=False, durable=False, error=error,
                        reasons=(f"kvci params rejected, LMCache saves nothing: {error}",), client_asked=True)
