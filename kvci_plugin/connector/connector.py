"""KVCheckpointConnector: the thin facade vLLM loads; it delegates by role.

`--kv-transfer-config '{"kv_connector": "KVCheckpointConnector",
"kv_connector_module_path": "kvci_plugin.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}'`. The scheduler role builds a `KVCIScheduler`, the worker
role a `KVCIWorker`; they share nothing but the per-step metadata.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvci_plugin.connector import release_fence, speculative
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.events import KVCIEvents
from kvci_plugin.connector.groups import GroupLayout, KVGroup
from kvci_plugin.connector.metadata import KVCIMetadata, KVCIWorkerMetadata
from kvci_plugin.connector.namespace import engine_namespace
from kvci_plugin.connector.request_state import HitTier
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.connector.stats import KVCIStats
from kvci_plugin.connector.tool_markers import tool_call_markers
from kvci_plugin.connector.worker import KVCIWorker
from kvci_plugin.governance import (
    CatalogLabelResolver,
    CredentialVerifier,
    DerivedAuthorityGate,
    RevocationList,
)
from kvci_plugin.logs import log_where_vllm_logs
from kvci_plugin.request.hints import KVHints, read_kv_hints
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.blobs.factory import open_blob_root
from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.health import DEPENDENCY_ERRORS
from kvci_plugin.tiering.secret import load_or_create_secret

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _kv_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
               groups: GroupLayout) -> str:
    """The resolved KV cache layout (e.g. LBNHC) and, for more than one group or a window, the
    groups: pages are copied in memory order per group, so pages of one layout must never load
    under another. The engine core records the layout in the cache config and each worker does
    before it builds its connector."""
    layout = vllm_config.cache_config.kv_cache_layout or kv_cache_config.kv_cache_layout
    plain = not groups.hybrid and groups.groups[0].full
    return (f"{vllm_config.device_config.device_type}/{layout or 'default'}/pages"
            + ("" if plain else "/groups=" + groups.describe()))


def _group_layout(kv_cache_config: KVCacheConfig, block_size: int) -> GroupLayout:
    """kvci keeps attention KV: full, sliding-window and chunked local-attention groups. A
    state-space (Mamba) or other group is refused at start, naming it: its state at a block
    boundary is not a page of KV."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            groups.append(KVGroup(tuple(group.layer_names), window=spec.sliding_window))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            groups.append(KVGroup(tuple(group.layer_names), chunk=spec.attention_chunk_size))
        elif isinstance(spec, FullAttentionSpec | UniformTypeKVCacheSpecs):
            groups.append(KVGroup(tuple(group.layer_names)))
        else:
            raise ValueError(
                f"kvci: KV cache group {i} ({', '.join(group.layer_names[:3])}...) is "
                f"{type(spec).__name__}: kvci keeps full-attention, sliding-window and chunked "
                "local-attention KV only; "
                "state-space (Mamba) and other layer kinds are not supported: remove "
                "--kv-transfer-config for this model")
    return GroupLayout(tuple(groups), block_size)


def _namespace(vllm_config: VllmConfig, config: KVCIConfig, kv_layout: str, tp_rank: int) -> bytes:
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return engine_namespace(
        model=mc.model,
        revision=mc.revision,
        revision_override=config.model_revision,
        kv_dtype=f"{cc.cache_dtype}/{mc.dtype}",
        block_size=cc.block_size,
        kv_layout=kv_layout,
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
    )


def _slot_bytes(kv_cache_config: KVCacheConfig) -> int:
    """A slot holds one group's pages of one block: the same size in every group (vLLM gives
    the groups of a hybrid model one page size, so they share one block pool)."""
    sizes = {g.kv_cache_spec.page_size_bytes * len(g.layer_names)
             for g in kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise ValueError(f"kvci: the KV cache groups' pages differ in size ({sorted(sizes)})")
    return sizes.pop()


def _kv_events(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
               num_slots: int) -> KVCIEvents | None:
    """Events only when vLLM publishes them (`--kv-events-config`): otherwise nothing is kept
    for them and no step pays for them."""
    events_config = vllm_config.kv_events_config
    if events_config is None or not events_config.enable_kv_cache_events:
        return None
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return KVCIEvents(vllm_config.cache_config.block_size, hash_block_size,
                      max_described=num_slots)


class KVCheckpointConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps a request's KV when it is worth keeping; loads it back when a prefix matches."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_where_vllm_logs()
        self._config = KVCIConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self._groups = _group_layout(kv_cache_config, vllm_config.cache_config.block_size)
        if (role == KVConnectorRole.SCHEDULER
                and self._kv_transfer_config.kv_load_failure_policy != "recompute"):
            if vllm_config.kv_transfer_config is self._kv_transfer_config:
                # kvci is a cache: a load it cannot deliver (a bad blob, a dependency outage,
                # a forget racing the load) is recomputed, never a failed request. vLLM's
                # scheduler reads the policy after building its connector.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                logger.warning("kvci: kv_load_failure_policy 'fail' set to 'recompute': a kvci "
                               "load that fails is recomputed, never a failed request")
            else:
                logger.warning(
                    "kvci: kv_load_failure_policy is %r (set by another connector): a kvci load "
                    "that fails will fail its request",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
        self._scheduler: KVCIScheduler | None = None
        self._worker: KVCIWorker | None = None
        self._kv_hints: dict[str, KVHints] = {}  # by request id, while the request lives
        cfg = self._config
        self._kv_layout = _kv_layout(vllm_config, kv_cache_config, self._groups)
        slot_bytes = _slot_bytes(kv_cache_config)
        num_slots = int(cfg.ram_bytes) // slot_bytes
        self._control = None
        if role == KVConnectorRole.SCHEDULER:
            speculative.note_at_start(vllm_config)
            self._scheduler = self._build_scheduler(vllm_config, kv_cache_config, slot_bytes)
            state_file = self._scheduler.config.policy_state_file
            if state_file is not None:
                logger.info("kvci: RAM tier policy state %s: %s", state_file,
                            "what it learned before the restart" if self._scheduler.policy_restored
                            else "learning afresh")
            if cfg.control_port is not None:
                from kvci_plugin.api.server import start_control_server

                self._control = start_control_server(self._scheduler.control, cfg)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = KVCIWorker(
                num_slots=num_slots, expected_slot_bytes=slot_bytes,
                num_blocks=kv_cache_config.num_blocks,
                rank_namespace=_namespace(vllm_config, cfg, self._kv_layout, rank),
                blob_root=(open_blob_root(cfg.blob_dsn(), cfg.disk_root, cfg.root_key,
                                          cfg.dependency_timeouts())
                           if cfg.disk_tier else None),
                group_layers=[list(g.layer_names) for g in self._groups.groups])
        logger.info("kvci: %s role, %d RAM slots of %d bytes, pages %s, disk tier %s", role.name,
                    num_slots, slot_bytes, self._kv_layout, "on" if cfg.disk_tier else "off")

    def _build_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                         slot_bytes: int) -> KVCIScheduler:
        cfg = self._config
        revocations = verifier = None
        if cfg.credentials is not None:
            revocations = RevocationList(cfg.revocation_db) if cfg.revocation_db else None
            verifier = CredentialVerifier(cfg.credentials, revocations)
        resolver = None
        if cfg.label_catalog is not None:
            resolver = CatalogLabelResolver(cfg.label_catalog)
            if cfg.label_catalog_json is not None:
                resolver.import_json(cfg.label_catalog_json)
        # The eligibility gate derives authority from verified credentials only: with none
        # configured it refuses every persist at verified_authority, naming the missing credential.
        # It is this engine's manager's, not installed process-wide.
        gate = DerivedAuthorityGate(verifier, resolver, durable_store_region=cfg.disk_region)
        namespace = _namespace(vllm_config, cfg, self._kv_layout, 0)
        disk = attach = None
        if cfg.disk_tier:
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            build = functools.partial(
                KVCheckpointStore, cfg.disk_root, namespace, int(cfg.disk_bytes),
                catalog_url=cfg.catalog_dsn(), blob_url=cfg.blob_dsn(), lease_s=cfg.lease_s,
                root_key=cfg.root_key, timeouts=cfg.dependency_timeouts(),
                shards=[_namespace(vllm_config, cfg, self._kv_layout, rank)
                        for rank in range(1, tp_size)])
            try:
                disk = build()
                logger.info("kvci: disk tier %s", disk.describe())
            except DEPENDENCY_ERRORS as exc:  # down now: the engine starts without it
                attach = DiskAttach(build, exc)
        secret = load_or_create_secret(cfg.state_dir)
        parallel = vllm_config.parallel_config
        return KVCIScheduler(
            config=cfg.for_data_parallel_rank(
                parallel.data_parallel_rank, parallel.data_parallel_size
            ),
            block_size=vllm_config.cache_config.block_size,
            slot_bytes=slot_bytes,
            namespace=namespace,
            secret=secret,
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            tenants=TenantResolver(verifier, cfg.tenancy),
            disk=disk,
            disk_attach=attach,
            layout=self._groups,
            events=_kv_events(vllm_config, kv_cache_config, int(cfg.ram_bytes) // slot_bytes),
            gate=gate,
            markers=tool_call_markers(vllm_config, cfg.tool_call_markers),
        )

    # ---- worker side ----------------------------------------------------------------------------
    # Every hook vLLM calls contains kvci's failures (connector/containment.py): the worker's
    # own fall back job by job; what escapes them is counted here and falls back to nothing.

    def _worker_hook(self, hook: str, call: Any, *args: Any, fallback: Any = None) -> Any:
        assert self._worker is not None
        try:
            return call(*args)
        except Exception as exc:
            self._worker.contain.fault(hook, exc)
            return fallback

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)  # a failure here is a start-up error: raised

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.34, EAGLE/MTP drafters: declined; vLLM keeps its EAGLE block drop, as on 0.32
        # and 0.33 (why, and what a kvci hit gives a drafter: connector/speculative.py).
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        # vLLM 0.34: kvci's workers copy pages in process (torch ops, kvci's copy kernels, views
        # over the tensors vLLM hands over), so the extensible KV cache may back the cache with
        # any allocation and commit its pages late (connector/worker.py, register_kv_caches).
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33 resets the connector's cache before a sleep of level 1 or 2 (so KV from
        # before weights were discarded never loads), then calls the hooks below.
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker_hook("unregister_kv_caches", self._worker.unregister_kv_caches)

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker_hook("restore_kv_caches", self._worker.restore_kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KVCIMetadata)
            self._worker.bind(connector_metadata)  # refuses jobs while asleep: vLLM's misuse

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker_hook("start_load_kv", self._worker.start_load_kv)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Called for every layer of every step: a step with no layer left to copy in returns.
        worker = self._worker
        if worker is not None and worker.layers_loading:
            self._worker_hook("wait_for_layer_load", worker.wait_for_layer_load, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # finished requests are stored whole in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker_hook("wait_for_save", self._worker.wait_for_save)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None:
            return self._worker_hook("get_finished", self._worker.get_finished, finished_req_ids,
                                     fallback=(None, None))
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's get_finished, plus the async loads that failed as a whole (recomputed)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving() if self._worker is not None else None
        if not (sending or recving or failed):
            return KVConnectorTransferResults()  # most steps: nothing finished
        failed = failed or set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVCIWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._worker_hook("build_connector_worker_meta", self._worker.take_report)
        return KVCIWorkerMetadata.of(report) if report is not None else None

    def shutdown(self) -> None:
        try:
            if self._worker is not None:
                self._worker.shutdown()
            if self._scheduler is not None:
                self._scheduler.shutdown()
        finally:
            if self._control is not None:
                self._control.stop()

    # ---- scheduler side -------------------------------------------------------------------------
    # The scheduler's hooks contain their own failures (a lookup's is a miss, a planned load's
    # is recomputed, a keep decision's keeps nothing new); what else escapes is counted here.

    def _scheduler_hook(self, hook: str, call: Any, *args: Any, fallback: Any = None) -> Any:
        assert self._scheduler is not None
        try:
            return call(*args)
        except Exception as exc:
            self._scheduler.contain.fault(hook, exc)
            return fallback

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            # A release of the KV cache (sleep, a weight update) fences what it outlived first.
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            if report is not None:
                self._scheduler_hook("fencing after a release", release_fence.fence_after_release,
                                     self._scheduler, report)
            self._scheduler.update_connector_output(connector_output)

    def may_load_async(self, request: Request) -> bool:
        # vLLM 0.34 (--max-num-inflight-kv-loads): a disk hit may be loaded asynchronously; the
        # rule, cheap and without a catalog query: connector/async_loads.py.
        return self._scheduler is not None and self._scheduler.may_load_async(request)

    def on_new_request(self, request: Request) -> None:
        # The orchestrator's KV hints (Request.kv_hints), read as plain data and kept while the
        # request lives; what cannot be read is said on a debug line, never a failed request.
        # kvci acts on its kvci.retain action (request_state.RequestStates.hinted_retain).
        hints = read_kv_hints(request)
        if hints is not None:
            self._kv_hints[request.request_id] = hints
            if hints.problems:
                logger.debug("kvci: request %s: %s", request.request_id, "; ".join(hints.problems))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._kv_hints.pop(request.request_id, None)
        return self._scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        """`reset_prefix_cache(reset_connector=True)`: after it, no KV computed before it is
        loaded from any kvci tier, on this node or any node sharing the disk catalog."""
        if self._scheduler is None:
            return True  # the workers follow the scheduler's generation at the next step
        try:
            self._scheduler.reset()
        except Exception:
            logger.exception("kvci: cache reset failed; the disk tier is not loaded from until "
                             "a reset succeeds")
            return False
        return True

    def take_events(self) -> list[KVCacheEvent]:
        if self._scheduler is None:
            return []
        return self._scheduler_hook("take_events", self._scheduler.take_events, fallback=[])

    def has_pending_push_work(self) -> bool:
        if self._scheduler is None:
            return False
        return self._scheduler_hook("has_pending_push_work", self._scheduler.has_pending_work,
                                    fallback=False)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0 or self._scheduler is None:
            return {}
        tier = self._scheduler.hit_tier(request.request_id)
        return {CacheHitSource.DISK if tier is HitTier.DISK else CacheHitSource.HOST:
                num_external_tokens}

    # ---- stats ----------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        part = self._scheduler or self._worker
        if part is None:
            return None
        try:
            stats = part.take_stats()
        except Exception as exc:
            part.contain.fault("take_stats", exc)
            return None
        return KVCIStats(data=stats.data) if stats is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVCIStats(data=data) if data is not None else KVCIStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from kvci_plugin.connector.prom import KVCIPromMetrics

        return KVCIPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
