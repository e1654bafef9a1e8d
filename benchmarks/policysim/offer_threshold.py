"""Store a block only once it has been offered N times (vLLM's ``store_threshold``; Dynamo KVBM
writes to disk only blocks seen at least twice)."""

from __future__ import annotations

from collections import OrderedDict

from pydantic import JsonValue

from benchmarks.policysim.admission import Admission
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest

# Offer counts remembered at once, least recently offered forgotten first; larger than the
# FAST'25 conversation trace's 182,790 distinct blocks, so there the count is exact.
DEFAULT_TRACKED_BLOCKS = 1 << 20


class StoreAfterNOffers:
    def __init__(self, threshold: int, *, tracked_blocks: int = DEFAULT_TRACKED_BLOCKS) -> None:
        for field, value in (("threshold", threshold), ("tracked_blocks", tracked_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        self.threshold = threshold
        self.tracked_blocks = tracked_blocks
        self.name = f"store-after-{threshold}"
        self._offers: OrderedDict[int, int] = OrderedDict()

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        offers = self._offers
        eligible = 0
        # Chained ids: a block is offered at most as often as any block before it, so the
        # blocks that reached the threshold are a leading run.
        for position, block in enumerate(request.hash_ids):
            count = offers.pop(block, 0) + 1
            offers[block] = count
            if count >= self.threshold and eligible == position:
                eligible += 1
        while len(offers) > self.tracked_blocks:
            offers.popitem(last=False)
        return Admission(eligible, eligible)

    def stats(self) -> dict[str, JsonValue]:
        return {"threshold": self.threshold, "tracked_blocks": self.tracked_blocks}
