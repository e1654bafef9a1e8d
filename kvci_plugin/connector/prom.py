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

from kvci_plugin.connector.containment import KINDS, TIERS, fault_counter
from kvci_plugin.governance import CHECK_ORDER, AlwaysDenyEligibility

logger = init_logger(__name__)

# The shipped gates' checks, the refusal recorded when the gate permits but no disk tier exists,
# and `other` for a check of a deployment's own gate (label values stay a fixed set).
CHECKS = (*CHECK_ORDER, AlwaysDenyEligibility.name, "no_disk_tier", "other")
_REFUSAL_PREFIX = "gate_refusals_"
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)

# KVCIStats counter name -> series and documentation.
_PLAIN = {
    "lookups": ("vllm:kvci_lookups", "Finished requests kvci looked up."),
    "checkpoints_ram": ("vllm:kvci_checkpoints", "Checkpoints kept in the RAM tier."),
    "evicted_checkpoints": (
        "vllm:kvci_evicted_checkpoints",
        "RAM checkpoints evicted to make room.",
    ),
    "store_declined": ("vllm:kvci_store_declined", "Keeps that did not fit the RAM tier."),
    "ram_refused_under_pressure": (
        "vllm:kvci_ram_refused_under_pressure",
        "Offers the RAM tier's policy found worth less than the checkpoints they would evict.",
    ),
    "ram_evicted_unread": (
        "vllm:kvci_ram_evicted_unread",
        "RAM checkpoints evicted before any load read them.",
    ),
    "store_opted_out": (
        "vllm:kvci_store_opted_out",
        "Requests whose client asked for checkpoint 'never'.",
    ),
    "cache_resets": (
        "vllm:kvci_cache_resets",
        "Cache resets (after weight updates): tiers fenced.",
    ),
    "checkpoints_fenced": (
        "vllm:kvci_checkpoints_fenced",
        "RAM and disk checkpoints a cache reset fenced.",
    ),
    "cache_reset_failures": (
        "vllm:kvci_cache_reset_failures",
        "Cache resets that could not fence the disk tier.",
    ),
    "disk_hits_declined": (
        "vllm:kvci_disk_hits_declined",
        "Disk hits recomputed because recomputing was measured clearly faster.",
    ),
    "persisted_checkpoints": (
        "vllm:kvci_persisted_checkpoints",
        "Checkpoints made durable on disk.",
    ),
    "persist_failures": ("vllm:kvci_persist_failures", "Persists whose blob writes failed."),
    "disk_load_errors": (
        "vllm:kvci_disk_load_errors",
        "Disk pages a load found missing or corrupt (recomputed, then forgotten).",
    ),
    "disk_checkpoints_discarded": (
        "vllm:kvci_disk_checkpoints_discarded",
        "Disk checkpoints forgotten because a page of theirs was bad.",
    ),
    "cache_gate_pauses": ("vllm:kvci_cache_gate_pauses", "Worthy keeps the cache gate paused."),
    "cache_gate_prefix_keeps": (
        "vllm:kvci_cache_gate_prefix_keeps",
        "Churn pauses that still kept the prefix the session's rewrites re-sent.",
    ),
    "params_errors": ("vllm:kvci_params_errors", "Requests whose kvci params were refused."),
    "ram_wasted_writes": (
        "vllm:kvci_ram_wasted_writes",
        "System-trigger RAM checkpoints evicted before any hit; each raised the RAM bar.",
    ),
    "ram_missed_reuses": (
        "vllm:kvci_ram_missed_reuses",
        "Requests that wanted a checkpoint the RAM bar alone held back; each lowered it.",
    ),
    "retentions_retained": ("vllm:kvci_retentions", "Retentions granted (kvci.retain)."),
    "retentions_refused": (
        "vllm:kvci_retentions_refused",
        "Retentions refused (over the tenant's quota, or the KV not kept).",
    ),
    "retentions_expired": ("vllm:kvci_retentions_expired", "Retentions ended by their TTL."),
    "retentions_released": (
        "vllm:kvci_retentions_released",
        "Retentions ended by their session's next request.",
    ),
}
_GAUGES = {
    "ram_threshold": ("vllm:kvci_ram_threshold",
                      ("The RAM threshold recommendations are scored at (the system trigger's bar; "
                       "it follows the RAM tier's pressure with ram_admission pressure).")),
    "ram_retained_bytes": ("vllm:kvci_ram_retained_bytes",
                           "RAM tier bytes exempt from eviction by retentions (kvci.retain)."),
}
# KVCIStats name prefix -> series, documentation, label name and its values (the name's suffix).
_LABELLED = {
    "hit_tokens_": (
        "vllm:kvci_hit_tokens",
        "Prompt tokens loaded from a kvci tier.",
        "tier",
        ("ram", "disk"),
    ),
    "failed_hit_tokens_": (
        "vllm:kvci_failed_hit_tokens",
        "Prompt tokens a kvci tier hit but could not load (vLLM recomputed them).",
        "tier",
        ("ram", "disk"),
    ),
    "loaded_bytes_": (
        "vllm:kvci_loaded_bytes",
        "Bytes loaded into the KV cache from a kvci tier.",
        "tier",
        ("ram", "disk"),
    ),
    "stored_bytes_": (
        "vllm:kvci_stored_bytes",
        "Bytes stored into a kvci tier (disk: persists).",
        "tier",
        ("ram", "disk"),
    ),
    "recommendations_": (
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
    "load_": ("vllm:kvci_load_seconds", "kvci load latency by tier.", "tier", ("ram", "disk")),
    "store_": ("vllm:kvci_store_seconds", "kvci store and persist latency by tier.", "tier",
               ("ram", "disk")),
    "phase_": ("vllm:kvci_load_phase_seconds",
               "A disk load's parts: reading and verifying the blobs, scattering them.", "phase",
               ("disk_read", "disk_scatter")),
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
        gauges.append(("tier_healthy_disk", "disk", healthy))
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
