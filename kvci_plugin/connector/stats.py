"""kvci's connector stats as vLLM's `KVConnectorStats`: the scheduler-side counts (lookups, hits,
recommendations, gate refusals) and the workers' transfer figures, counted by `StatsTally`."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvci_plugin.connector.tally import StatsTally


@dataclass
class KVCIStats(StatsTally, KVConnectorStats):
    pass
