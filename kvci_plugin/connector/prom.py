"""kvci's Prometheus series on vLLM's /metrics, fed from the aggregated `KVCIStats.data`.

vLLM builds this in the API server process (`build_prom_metrics`) and calls `observe` with each
step's stats, summed over the workers and the scheduler. Numbers only: every label value is a
tier or a gate check name from a fixed set, never token text, keys, tenants or credentials.

    vllm:kvci_lookups_total                     finished requests that were looked up
    vllm:kvci_hit_tokens_total{tier}            prompt tokens loaded from the RAM / disk tier
    vllm:kvci_failed_hit_tokens_total{tier}     prompt tokens hit but not loaded (recomputed)
    vllm:kvci_loaded_bytes_total{tier}          bytes loaded into the KV cache, by tier
    vllm:kvci_stored_bytes_total{tier}          bytes stored: tier=ram copies, tier=disk persists
    vllm:kvci_checkpoints_total                 checkpoints kept in RAM
    vllm:kvci_evicted_checkpoints_total         RAM checkpoints evicted to make room
    vllm:kvci_store_declined_total              keeps that did not fit the RAM tier
    vllm:kvci_store_opted_out_total             requests whose client asked for checkpoint "never"
    vllm:kvci_cache_resets_total                cache resets (after weight updates)
    vllm:kvci_checkpoints_fenced_total          RAM and disk checkpoints a cache reset fenced
    vllm:kvci_cache_reset_failures_total        resets that could not fence the disk tier
    vllm:kvci_disk_hits_declined_total          disk hits recomputed: measured to be clearly faster
    vllm:kvci_persisted_checkpoints_total       checkpoints made durable on disk
    vllm:kvci_persist_failures_total            persists whose blob writes failed
    vllm:kvci_disk_load_errors_total            disk pages a load found missing or corrupt
    vllm:kvci_disk_checkpoints_discarded_total  disk checkpoints forgotten for a bad page
    vllm:kvci_gate_refusals_total{check}        persists the eligibility gate refused, by check
    vllm:kvci_recommendations_total{tier}       recommendations by recommended tier
    vllm:kvci_cache_gate_pauses_total           worthy keeps the cache gate paused
    vllm:kvci_cache_gate_prefix_keeps_total     churn pauses that still kept the prefix every
                                                rewrite re-sent
    vllm:kvci_params_errors_total               requests whose kvci params were refused
    vllm:kvci_ram_refused_under_pressure_total  offers the RAM tier's policy found worth less
                                                than what they would evict
    vllm:kvci_ram_evicted_unread_total          RAM checkpoints evicted before any load read them
    vllm:kvci_ram_wasted_writes_total           system checkpoints evicted before any hit (bar up)
    vllm:kvci_ram_missed_reuses_total           requests wanting a checkpoint the bar held back
                                                (bar down)
    vllm:kvci_ram_threshold                     the RAM threshold recommendations are scored at
                                                (gauge)
    vllm:kvci_retentions_total                  retentions granted (kvci.retain)
    vllm:kvci_retentions_refused_total          retentions refused (over the tenant quota, not kept)
    vllm:kvci_retentions_expired_total          retentions ended by their TTL
    vllm:kvci_retentions_released_total         retentions ended by their session's next request
    vllm:kvci_ram_retained_bytes                RAM bytes exempt from eviction by retentions (gauge)
    vllm:kvci_tool_calls_detected_total         turns whose output held a tool-call marker
    vllm:kvci_retentions_automatic_total        of them, retained through the tool's pause
    vllm:kvci_retentions_automatic_hits_total   automatic retentions the session's next request
                                                loaded
    vllm:kvci_retentions_automatic_expired_total  automatic retentions whose TTL ended unused
    vllm:kvci_retentions_kv_hints_total         retentions granted on a kvci.retain KV hint
    vllm:kvci_window_stages_total               sliding windows copied during prefill (#47)
    vllm:kvci_window_stages_skipped_total       windows not copied: no room without evicting
    vllm:kvci_window_boundaries_missed_total    boundaries whose window had left vLLM's tables
    vllm:kvci_faults_total{tier,kind}           failures kvci contained (tier ram | disk; kind
                                                unavailable | timeout | internal)
    vllm:kvci_tier_healthy{tier}                1 while the tier's dependencies answer, 0 while
                                                it is degraded and skipped (gauge; tier=disk)
    vllm:kvci_load_seconds{tier}                load latency (histogram)
    vllm:kvci_store_seconds{tier}               store / persist latency (histogram)
    vllm:kvci_load_phase_seconds{phase}         a disk load's parts: disk_read (read and verify
                                                the blobs), disk_scatter (into the KV cache)
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.containment import KINDS, TIERS, fault_counter
from kvci_plugin.governance import CHECK_ORDER, AlwaysDenyEligibility

logger = init_logger(__name__)

# The shipped gates' checks, the refusal recorded when the gate permits but no disk tier exists,
# and `other` for a check of a deployment's own gate (label values stay a fixed set).
CHECKS = (*CHECK_ORDER, AlwaysDenyEligibility.name, "no_disk_tier", "other")
_REFUSAL_PREFIX = c.GATE_REFUSALS
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)

# KVCIStats counter name (`counters.py`) -> series and documentation.
_PLAIN = {
    c.LOOKUPS: ("vllm:kvci_lookups", "Finished requests kvci looked up."),
    c.CHECKPOINTS_RAM: ("vllm:kvci_checkpoints", "Checkpoints kept in the RAM tier."),
    c.EVICTED_CHECKPOINTS: (
        "vllm:kvci_evicted_checkpoints",
        "RAM checkpoints evicted to make room.",
    ),
    c.STORE_DECLINED: ("vllm:kvci_store_declined", "Keeps that did not fit the RAM tier."),
    c.RAM_REFUSED_UNDER_PRESSURE: (
        "vllm:kvci_ram_refused_under_pressure",
        "Offers the RAM tier's policy found worth less than the checkpoints they would evict.",
    ),
    c.RAM_EVICTED_UNREAD: (
        "vllm:kvci_ram_evicted_unread",
        "RAM checkpoints evicted before any load read them.",
    ),
    c.STORE_OPTED_OUT: (
        "vllm:kvci_store_opted_out",
        "Requests whose client asked for checkpoint 'never'.",
    ),
    c.CACHE_RESETS: (
        "vllm:kvci_cache_resets",
        "Cache resets (after weight updates): tiers fenced.",
    ),
    c.CHECKPOINTS_FENCED: (
        "vllm:kvci_checkpoints_fenced",
        "RAM and disk checkpoints a cache reset fenced.",
    ),
    c.CACHE_RESET_FAILURES: (
        "vllm:kvci_cache_reset_failures",
        "Cache resets that could not fence the disk tier.",
    ),
    c.DISK_HITS_DECLINED: (
        "vllm:kvci_disk_hits_declined",
        "Disk hits recomputed because recomputing was measured clearly faster.",
    ),
    c.PERSISTED_CHECKPOINTS: (
        "vllm:kvci_persisted_checkpoints",
        "Checkpoints made durable on disk.",
    ),
    c.PERSIST_FAILURES: ("vllm:kvci_persist_failures", "Persists whose blob writes failed."),
    c.DISK_LOAD_ERRORS: (
        "vllm:kvci_disk_load_errors",
        "Disk pages a load found missing or corrupt (recomputed, then forgotten).",
    ),
    c.DISK_CHECKPOINTS_DISCARDED: (
        "vllm:kvci_disk_checkpoints_discarded",
        "Disk checkpoints forgotten because a page of theirs was bad.",
    ),
    c.CACHE_GATE_PAUSES: ("vllm:kvci_cache_gate_pauses", "Worthy keeps the cache gate paused."),
    c.CACHE_GATE_PREFIX_KEEPS: (
        "vllm:kvci_cache_gate_prefix_keeps",
        "Churn pauses that still kept the prefix the session's rewrites re-sent.",
    ),
    c.PARAMS_ERRORS: ("vllm:kvci_params_errors", "Requests whose kvci params were refused."),
    c.RAM_WASTED_WRITES: (
        "vllm:kvci_ram_wasted_writes",
        "System-trigger RAM checkpoints evicted before any hit; each raised the RAM bar.",
    ),
    c.RAM_MISSED_REUSES: (
        "vllm:kvci_ram_missed_reuses",
        "Requests that wanted a checkpoint the RAM bar alone held back; each lowered it.",
    ),
    c.RETENTIONS_RETAINED: ("vllm:kvci_retentions", "Retentions granted (kvci.retain)."),
    c.TOOL_CALLS_DETECTED: ("vllm:kvci_tool_calls_detected",
                            "Turns whose output held one of the model's tool-call markers."),
    c.RETENTIONS_AUTOMATIC: ("vllm:kvci_retentions_automatic",
                             "Tool-call turns retained through the pause for a learned TTL."),
    c.RETENTIONS_AUTOMATIC_HITS: (
        "vllm:kvci_retentions_automatic_hits",
        "Automatic retentions whose checkpoint the session's next request loaded.",
    ),
    c.RETENTIONS_AUTOMATIC_EXPIRED: (
        "vllm:kvci_retentions_automatic_expired",
        "Automatic retentions whose TTL ended before the session's next request.",
    ),
    c.RETENTIONS_KV_HINTS: ("vllm:kvci_retentions_kv_hints",
                            "Retentions granted on a kvci.retain action of vLLM's KV hints."),
    c.RETENTIONS_REFUSED: (
        "vllm:kvci_retentions_refused",
        "Retentions refused (over the tenant's quota, or the KV not kept).",
    ),
    c.RETENTIONS_EXPIRED: ("vllm:kvci_retentions_expired", "Retentions ended by their TTL."),
    c.RETENTIONS_RELEASED: (
        "vllm:kvci_retentions_released",
        "Retentions ended by their session's next request.",
    ),
    c.WINDOW_STAGES: (
        "vllm:kvci_window_stages",
        "Sliding-window windows copied into RAM during prefill (window_stages).",
    ),
    c.WINDOW_STAGES_SKIPPED: (
        "vllm:kvci_window_stages_skipped",
        "Windows not copied: they did not fit without evicting (or window_stage_bytes).",
    ),
    c.WINDOW_BOUNDARIES_MISSED: (
        "vllm:kvci_window_boundaries_missed",
        "Window boundaries whose window had left vLLM's block tables when reached.",
    ),
}
_GAUGES = {
    c.RAM_THRESHOLD: ("vllm:kvci_ram_threshold",
                      ("The RAM threshold recommendations are scored at (the system trigger's bar; "
                       "it follows the RAM tier's pressure with ram_admission pressure).")),
    c.RAM_RETAINED_BYTES: ("vllm:kvci_ram_retained_bytes",
                           "RAM tier bytes exempt from eviction by retentions (kvci.retain)."),
}
# KVCIStats name prefix -> series, documentation, label name and its values (the name's suffix).
_LABELLED = {
    c.HIT_TOKENS: (
        "vllm:kvci_hit_tokens",
        "Prompt tokens loaded from a kvci tier.",
        "tier",
        ("ram", "disk"),
    ),
    c.FAILED_HIT_TOKENS: (
        "vllm:kvci_failed_hit_tokens",
        "Prompt tokens a kvci tier hit but could not load (vLLM recomputed them).",
        "tier",
        ("ram", "disk"),
    ),
    c.LOADED_BYTES: (
        "vllm:kvci_loaded_bytes",
        "Bytes loaded into the KV cache from a kvci tier.",
        "tier",
        ("ram", "disk"),
    ),
    c.STORED_BYTES: (
        "vllm:kvci_stored_bytes",
        "Bytes stored into a kvci tier (disk: persists).",
        "tier",
        ("ram", "disk"),
    ),
    c.RECOMMENDATIONS: (
        "vllm:kvci_recommendations",
        "Recommendations by recommended tier.",
        "tier",
        ("none", "ram", "disk"),
    ),
    _REFUSAL_PREFIX: (
        "vllm:kvci_gate_refusals",
        "Persists the eligibility gate refused, by check.",
        "check",
        CHECKS,
    ),
}
_LATENCY = {
    c.LOAD_SECONDS: ("vllm:kvci_load_seconds", "kvci load latency by tier.", "tier",
                     ("ram", "disk")),
    c.STORE_SECONDS: ("vllm:kvci_store_seconds", "kvci store and persist latency by tier.",
                      "tier", ("ram", "disk")),
    c.PHASE_SECONDS: ("vllm:kvci_load_phase_seconds",
                      "A disk load's parts: reading and verifying the blobs, scattering them.",
                      "phase", ("disk_read", "disk_scatter")),
}


class KVCIPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = list(self._labelnames)
        # (stats name, extra label value or None, metric): every series is created up front, so
        # /metrics shows zeros before any traffic.
        counters: list[tuple[str, Any, Any]] = []
        for name, (metric_name, doc) in _PLAIN.items():
            counters.append((name, None, self._counter_cls(name=metric_name, documentation=doc,
                                                           labelnames=labels)))
        for prefix, (metric_name, doc, label, values) in _LABELLED.items():
            counter = self._counter_cls(
                name=metric_name, documentation=doc, labelnames=labels + [label]
            )
            counters += [(prefix + value, value, counter) for value in values]
        faults = self._counter_cls(
            name="vllm:kvci_faults", labelnames=labels + ["tier", "kind"],
            documentation="Failures kvci contained (the request went on as a miss, a recompute "
            "or a store not kept), by tier and kind.")
        counters += [(fault_counter(tier, kind), [tier, kind], faults)
                     for tier in TIERS for kind in KINDS]
        histograms: list[tuple[str, str | None, Any]] = []
        for prefix, (metric_name, doc, label, values) in _LATENCY.items():
            histogram = self._histogram_cls(
                name=metric_name,
                documentation=doc,
                buckets=LATENCY_BUCKETS,
                labelnames=labels + [label],
            )
            histograms += [(prefix + value, value, histogram) for value in values]
        # The latest value wins: with several API server processes, the most recent report.
        gauges = [
            (
                name,
                None,
                self._gauge_cls(
                    name=metric_name,
                    documentation=doc,
                    labelnames=labels,
                    multiprocess_mode="mostrecent",
                ),
            )
            for name, (metric_name, doc) in _GAUGES.items()
        ]
        healthy = self._gauge_cls(
            name="vllm:kvci_tier_healthy", labelnames=labels + ["tier"],
            documentation="1 while the tier's dependencies answer; 0 while it is degraded "
            "(skipped: lookups miss, writes are dropped) and probed until they answer.",
            multiprocess_mode="mostrecent")
        gauges.append((c.TIER_HEALTHY + "disk", "disk", healthy))
        self._counters = self._bind(counters)
        self._histograms = self._bind(histograms)
        self._gauges = self._bind(gauges)

    def _bind(self, series: list[tuple[str, Any, Any]]) -> dict[tuple[int, str], Any]:
        bound: dict[tuple[int, str], Any] = {}
        for engine_idx, engine_labels in self.per_engine_labelvalues.items():
            for name, extra, metric in series:
                extra_values = ([] if extra is None else list(extra) if isinstance(extra, list)
                                else [extra])
                bound[(engine_idx, name)] = metric.labels(*engine_labels, *extra_values)
        return bound

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            counter = self._counters.get((engine_idx, name))
            if counter is None and name.startswith(_REFUSAL_PREFIX):
                counter = self._counters[(engine_idx, _REFUSAL_PREFIX + "other")]
            if counter is None:
                logger.warning_once("kvci: no Prometheus series for stats counter %r", name)
            elif value:
                counter.inc(value)
        for name, samples in transfer_stats_data.get("latency", {}).items():
            histogram = self._histograms.get((engine_idx, name))
            if histogram is None:
                logger.warning_once("kvci: no Prometheus series for latency %r", name)
                continue
            for seconds in samples:
                histogram.observe(seconds)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            gauge = self._gauges.get((engine_idx, name))
            if gauge is None:
                logger.warning_once("kvci: no Prometheus series for gauge %r", name)
            else:
                gauge.set(value)
