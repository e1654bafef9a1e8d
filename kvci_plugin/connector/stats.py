"""kvci's connector stats: numbers only — never token text, keys or credentials.

Counters are summed across workers and intervals; latency samples are kept per interval for the
histograms; gauges (the scheduler's current RAM bar) keep the latest value. The same class
carries scheduler-side counts (lookups, hits, recommendations, gate refusals) and worker-side
transfer figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_MAX_SAMPLES = 4096  # per interval; enough for the histograms, bounded for msgpack


@dataclass
class KVCIStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "latency": {}, "gauges": {}})

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("latency", {})
        self.data.setdefault("gauges", {})

    def count(self, name: str, n: int | float = 1) -> None:
        c = self.data["counters"]
        c[name] = c.get(name, 0) + n

    def gauge(self, name: str, value: float) -> None:
        self.data["gauges"][name] = value

    def _sample(self, name: str, seconds: float) -> None:
        s = self.data["latency"].setdefault(name, [])
        if len(s) < _MAX_SAMPLES:
            s.append(seconds)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        self.count(f"loaded_bytes_{tier}", nbytes)
        self._sample(f"load_{tier}", seconds)

    def observe_store(self, tier: str, nbytes: int, seconds: float) -> None:
        self.count(f"stored_bytes_{tier}", nbytes)
        self._sample(f"store_{tier}", seconds)

    def reset(self) -> None:
        self.data = {"counters": {}, "latency": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> "KVCIStats":
        for k, v in other.data.get("counters", {}).items():
            self.count(k, v)
        for k, vs in other.data.get("latency", {}).items():
            for v in vs:
                self._sample(k, v)
        # `other` is the later report (or the scheduler's, merged into the workers'): it wins.
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {**self.data["counters"], **self.data["gauges"]}
        for k, vs in self.data["latency"].items():
            if vs:
                out[f"{k}_mean_s"] = sum(vs) / len(vs)
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["latency"] and not self.data["gauges"]
