"""The control for any selective policy: admit whole requests at random, at a given rate.

A selective policy that writes less can win just by polluting the cache less; this one writes
as little, chosen blindly, so what the selective policy gains beyond it is what its choice is
worth.
"""

from __future__ import annotations

import random

from pydantic import JsonValue

from benchmarks.policysim.admission import NOTHING, Admission
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest


class RandomAdmission:
    def __init__(self, probability: float, *, seed: int) -> None:
        if (
            isinstance(probability, bool)
            or not isinstance(probability, (int, float))
            or not 0.0 <= probability <= 1.0
        ):
            raise ValueError(f"probability must be a number in [0, 1], got {probability!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.name = "random"
        self.probability = float(probability)
        self.seed = seed
        self._rng = random.Random(seed)

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        if self._rng.random() >= self.probability:
            return NOTHING
        blocks = len(request.hash_ids)
        return Admission(blocks, blocks)

    def stats(self) -> dict[str, JsonValue]:
        return {"probability": self.probability, "seed": self.seed}
