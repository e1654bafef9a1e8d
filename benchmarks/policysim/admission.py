"""The admission decision: after a request is served, which of its blocks each tier writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import JsonValue

from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class Admission:
    """How many leading blocks of the request's chain each tier should hold (0 = none).

    Always a leading run: a block past a missing one can never be hit (hits are prefix runs).
    """

    ram_blocks: int
    disk_blocks: int


NOTHING = Admission(0, 0)


class AdmissionPolicy(Protocol):
    name: str

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        """Called once per request, after its lookup found ``hit_tokens`` already cached."""
        ...

    def stats(self) -> dict[str, JsonValue]:
        """Counters that explain the decisions (for the JSON report)."""
        ...


class StoreEverything:
    """Every block of every request to every tier: vLLM's native offloading and LMCache by
    default."""

    def __init__(self, name: str) -> None:
        self.name = name

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        blocks = len(request.hash_ids)
        return Admission(blocks, blocks)

    def stats(self) -> dict[str, JsonValue]:
        return {}
