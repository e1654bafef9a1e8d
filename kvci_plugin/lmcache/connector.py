"""KVCILMCacheConnector: LMCache's vLLM connector with kvci deciding each request's save.

`--kv-transfer-config '{"kv_connector": "KVCILMCacheConnector",
"kv_connector_module_path": "kvci_plugin.lmcache", "kv_role": "kv_both",
"kv_connector_extra_config": {"lmcache.*": ..., "kvci": {...}}}'`

A subclass of vLLM's `LMCacheConnectorV1`, so every connector method is LMCache's own except the
three scheduler hooks below, which add kvci's decision and hand over to LMCache unchanged. (A
wrapper object would have to forward each method by hand and would silently fall back to the
base class's no-op for any method a later vLLM adds.)

- `get_num_new_matched_tokens`: the admission point. kvci decides and writes the decision into
  the request's `lmcache.*` entries before LMCache's lookup reads them (the tenant tag is part
  of the lookup key).
- `build_connector_meta`: decides for any newly scheduled request not yet decided, before
  LMCache's `RequestTracker.from_new_request` snapshots `lmcache.skip_save` for the request's
  whole life.
- `request_finished`: adds the decision and its reasons to the response's kv_transfer_params,
  under `kvci`, next to whatever LMCache returns — only when the client sent a `kvci` object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
from vllm.logger import init_logger

from kvci_plugin.governance import (
    CatalogLabelResolver,
    CredentialVerifier,
    DerivedAuthorityGate,
    RevocationList,
    set_persistence_eligibility_gate,
)
from kvci_plugin.lmcache.admission import AdmissionPolicy
from kvci_plugin.lmcache.config import KVCILMCacheConfig
from kvci_plugin.lmcache.decision import SaveDecision
from kvci_plugin.lmcache.gated_tiers import GatedTiers
from kvci_plugin.lmcache.lmcache_config import effective_lmcache_config, gated_tiers
from kvci_plugin.lmcache.request_configs import durable_marker, tenant_tag, write_decision
from kvci_plugin.logs import log_where_vllm_logs
from kvci_plugin.request.tenancy import TenantResolver

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KVCILMCacheConnector(LMCacheConnectorV1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        log_where_vllm_logs()
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError("KVCILMCacheConnector needs vLLM's kv_transfer_config")
        extra = transfer.kv_connector_extra_config
        config = KVCILMCacheConfig.from_extra_config(extra)
        # Checked before LMCache builds a backend: an ungated durable tier is never constructed.
        tiers = gated_tiers(effective_lmcache_config(extra))
        super().__init__(vllm_config, role, kv_cache_config)
        self._policy: AdmissionPolicy | None = None
        self._decisions: dict[str, SaveDecision] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._policy = _build_policy(config, tiers)
        logger.info("kvci: LMCache facade, %s role, gated durable tiers: %s", role.name,
                    ", ".join(tiers.accepting(None)) or "none")

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._admit(request.request_id, request.sampling_params, request.num_prompt_tokens, request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self._admit(new.req_id, new.sampling_params, new.prompt_len)
        return super().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        decision = self._decisions.pop(request.request_id, None)
        if decision is None or not decision.client_asked:
            return delay, params  # nothing asked, nothing said
        return delay, {**(params or {}), "kvci": decision.reply()}

    def _admit(self, request_id: str, sampling_params: Any, prompt_tokens: int,
               request: Request | None = None) -> None:
        """Decide once per request and write the decision where LMCache reads it."""
        if request_id in self._decisions or sampling_params is None:
            # Pooling requests carry no sampling params, hence no kv_transfer_params: LMCache's
            # per-request switch cannot reach them (and without a permit no gated tier takes them).
            return
        assert self._policy is not None, "admission runs on the scheduler side only"
        kv_transfer_params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        decision = self._policy.decide(request_id, kv_transfer_params, prompt_tokens)
        written = write_decision(
            sampling_params, skip_save=not decision.save,
            tag=tenant_tag(decision.tenant, self._policy.tenants.default),
            durable=durable_marker(decision.retention_expiry) if decision.durable else None)
        if request is not None:
            request.kv_transfer_params = written
        self._decisions[request_id] = decision


def _build_policy(config: KVCILMCacheConfig, tiers: GatedTiers) -> AdmissionPolicy:
    verifier = None
    if config.credentials is not None:
        revocations = (
            RevocationList(config.revocation_db) if config.revocation_db is not None else None
        )
        verifier = CredentialVerifier(config.credentials, revocations)
    resolver = None
    if config.label_catalog is not None:
        resolver = CatalogLabelResolver(config.label_catalog)
        if config.label_catalog_json is not None:
            resolver.import_json(config.label_catalog_json)
    # As in kvci's own connector: authority comes from verified credentials only, so with none
    # configured every durable request is refused at verified_authority, naming the gap.
    set_persistence_eligibility_gate(
        DerivedAuthorityGate(verifier, resolver, durable_store_region=config.durable_region)
    )
    return AdmissionPolicy(config, TenantResolver(verifier), tiers)
