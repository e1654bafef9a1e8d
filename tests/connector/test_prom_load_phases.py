"""A disk load's parts reach Prometheus as `vllm:kvci_load_phase_seconds{phase}` (no engine:
kvci's series over a registry of their own, fed a worker's real stats)."""

from __future__ import annotations

import functools
import types

import prometheus_client as pc

from kvci_plugin.connector.prom import KVCIPromMetrics
from kvci_plugin.connector.tally import StatsTally


def test_a_disk_loads_read_and_scatter_parts_are_histograms() -> None:
    registry = pc.CollectorRegistry()
    types_ = {
        cls: functools.partial(cls, registry=registry)
        for cls in (pc.Gauge, pc.Counter, pc.Histogram)
    }
    metrics = KVCIPromMetrics(
        types.SimpleNamespace(kv_transfer_config=None), types_, ["engine"], {0: ["0"]}
    )
    stats = StatsTally()
    stats.observe_load("disk", 1 << 20, 0.006)
    stats.observe_phase("disk_read", 0.004)
    stats.observe_phase("disk_scatter", 0.0015)
    metrics.observe(stats.data, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("vllm:kvci_load_phase_seconds_sum", phase="disk_read") == 0.004
    assert value("vllm:kvci_load_phase_seconds_sum", phase="disk_scatter") == 0.0015
    assert value("vllm:kvci_load_phase_seconds_count", phase="disk_read") == 1
    assert value("vllm:kvci_load_seconds_sum", tier="disk") == 0.006
