"""Contained failures and the disk tier's health reach Prometheus as
`vllm:kvci_faults_total{tier,kind}` and `vllm:kvci_tier_healthy{tier}` (no engine: kvci's series
over a registry of their own, fed the stats a real Containment counted)."""

from __future__ import annotations

import functools
import types

import prometheus_client as pc

from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.prom import KVCIPromMetrics
from kvci_plugin.connector.tally import StatsTally


def test_faults_by_tier_and_kind_and_the_disk_tiers_health() -> None:
    registry = pc.CollectorRegistry()
    types_ = {
        cls: functools.partial(cls, registry=registry)
        for cls in (pc.Gauge, pc.Counter, pc.Histogram)
    }
    metrics = KVCIPromMetrics(
        types.SimpleNamespace(kv_transfer_config=None), types_, ["engine"], {0: ["0"]}
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("vllm:kvci_faults_total", tier="disk", kind="timeout") == 0  # shown before any
    stats = StatsTally()
    contain = Containment(stats.count)
    contain.fault("a lookup", TimeoutError("no answer"), tier="disk")
    contain.fault("a lookup", ConnectionRefusedError("down"), tier="disk")
    contain.fault("planning a load", KeyError("page"))
    stats.gauge("tier_healthy_disk", 0.0)
    metrics.observe(stats.data, 0)
    assert value("vllm:kvci_faults_total", tier="disk", kind="timeout") == 1
    assert value("vllm:kvci_faults_total", tier="disk", kind="unavailable") == 1
    assert value("vllm:kvci_faults_total", tier="ram", kind="internal") == 1
    assert value("vllm:kvci_tier_healthy", tier="disk") == 0
