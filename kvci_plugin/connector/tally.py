"""The counting behind kvci's connector stats, free of vllm: `stats.py` makes it vLLM's class.

Numbers only — never token text, keys or credentials. Counters are summed across workers and
intervals; latency samples are kept per interval for the histograms; gauges (the scheduler's
current RAM bar) keep the latest value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MAX_SAMPLES = 4096  # per interval; enough for the histograms, bounded for msgpack


def _empty() -> dict[str, Any]:
    return {"counters": {}, "latency": {}, "gauges": {}}


@dataclass
class StatsTally:
    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for part in _empty():
            self.data.setdefault(part, {})

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

    def observe_phase(self, name: str, seconds: float) -> None:
        """One part of a load (``disk_read``, ``disk_scatter``): where its time went."""
        self._sample(f"phase_{name}", seconds)

    def observe_store(self, tier: str, nbytes: int, seconds: float) -> None:
        self.count(f"stored_bytes_{tier}", nbytes)
        self._sample(f"store_{tier}", seconds)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: Any) -> Any:
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
