"""The offline bound: Belady's MIN with bypass (Belady 1966; the bypass form as in Mattson et al.
1970), at block granularity, under the replay's rules. It reads the future: a bound, not a policy.

The rule, decided once per request, from the chain's root to its tail, for each block the RAM
tier lacks: a block never used again is not written, nor anything after it; with the tier full,
the block is written only if its next use comes sooner than that of the resident whose next use
is farthest, which it then evicts; else it is bypassed, and so is the rest of the chain.

"Next use" is a position in the trace flattened to (request, block position) order, so a block's
key is (index of the next request holding it, its position). On a chained trace (a hash id names
its whole prefix, so a block always sits at one position behind one predecessor) every request
holding a block holds its predecessor too: a predecessor's key is always smaller than its
successor's. Hence eviction takes a chain from its tail and a bypass stops the chain, and the
resident set stays closed under predecessors: every resident block of a request lies in its
leading run, so each resident block the request holds is a hit. That is the "hits are prefix runs"
rule built in: the bound never writes a block whose predecessor it lacks.

What it bounds: the RAM hit blocks of every policy replayed under these rules with the same RAM
capacity. Any such policy's hits are at most its resident (request, position) pairs, and a policy
that writes a request's blocks after its lookup is matched by one that writes each at its access
in the flattened order; among those, MIN with bypass has the most resident accesses, and here
each of them is a hit. A use is a position a hit can cover (``TraceRequest.hit_blocks``: full
blocks, never the last token) and only full blocks are written, as for every policy; saved tokens
are hit blocks x 512, so the bound holds on saved tokens exactly. On a trace that is not chained
(``stats["chained"]`` false) the rule still runs but is a reference, not a proven bound.

Efficiency: next uses are precomputed per (request, position) in one backward pass; the farthest
resident comes from a heap with lazy deletion (a stale entry is skipped when it surfaces).

As a replay pair, the bound is both the admission policy and the RAM tier: ``admit`` plans the
request's writes and evictions, then the replay's ``insert`` writes exactly the planned blocks.
The disk tier, when there is one, gets every block, as store-everything gives it: the bound is
on the RAM tier's hits, so with a disk tier another policy's RAM and disk hits together may exceed
the bound's.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from pydantic import JsonValue

from benchmarks.policysim.admission import Admission
from benchmarks.policysim.block_cache import check_capacity
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest

NAME = "belady"


def next_uses(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request and full block position: the index of the next request whose hit could
    cover that block (``len(requests)``: never again)."""
    never = len(requests)
    following: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        request = requests[index]
        out[index] = [
            following.get(block, never) for block in request.hash_ids[: request.full_blocks]
        ]
        for block in request.hash_ids[: request.hit_blocks]:
            following[block] = index
    return out


def is_chained(requests: Sequence[TraceRequest]) -> bool:
    """Does every block always follow the same predecessor (so sits at one position)?"""
    before: dict[int, int] = {}
    for request in requests:
        previous = -1
        for block in request.hash_ids:
            if before.setdefault(block, previous) != previous:
                return False
            previous = block
    return True


class BeladyBound:
    """Must see the requests of ``requests`` in order, once each."""

    name = NAME

    def __init__(self, requests: Sequence[TraceRequest], capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self._chains = [request.hash_ids for request in requests]
        self._next = next_uses(requests)
        self._never = len(requests)
        self._chained = is_chained(requests)
        self._now = -1
        # Resident and planned blocks -> (next use, position); planned ones are not yet written.
        self._key: dict[int, tuple[int, int]] = {}
        self._planned: set[int] = set()
        # (-next use, -position, block): the farthest first; stale entries are skipped.
        self._heap: list[tuple[int, int, int]] = []
        self.bypassed = 0
        self.never_used_again = 0
        self.evicted = 0

    # --- the RAM tier --------------------------------------------------------------------------

    def __contains__(self, block: int) -> bool:
        return block in self._key and block not in self._planned

    def __len__(self) -> int:
        return len(self._key) - len(self._planned)

    def touch(self, block: int) -> None:
        """Uses are read from the trace, not from the replay."""

    def refresh(self, block: int) -> None:
        """Order is by next use, not recency."""

    def insert(self, block: int) -> bool:
        if block in self._key and block not in self._planned:
            raise ValueError(f"block {block} is already resident: touch it instead")
        if block not in self._planned:
            return False
        self._planned.remove(block)
        return True

    # --- the admission -------------------------------------------------------------------------

    def admit(self, request: TraceRequest, context: RequestContext, hit_tokens: int) -> Admission:
        self._now += 1
        if self._now >= len(self._chains) or self._chains[self._now] != request.hash_ids:
            raise ValueError(
                f"request {self._now + 1} is not the bound's trace's request {self._now + 1}"
            )
        if self._planned:
            raise ValueError(f"the replay did not write planned blocks {sorted(self._planned)}")
        chain, nexts = request.hash_ids[: request.full_blocks], self._next[self._now]
        lead = None
        for position, block in enumerate(chain):
            if block in self._key:
                self._set(block, nexts[position], position)
            elif lead is None:
                lead = position
        if lead is None:
            return Admission(len(chain), len(chain))
        kept = lead
        for position in range(lead, len(chain)):
            block, key = chain[position], (nexts[position], position)
            if block in self._key:  # only on a trace that is not chained
                break
            if key[0] == self._never:
                self.never_used_again += len(chain) - position
                break
            if len(self._key) >= self.capacity:
                farthest, far_key = self._farthest()
                if key >= far_key:
                    self.bypassed += len(chain) - position
                    break
                del self._key[farthest]
                self.evicted += 1
            self._set(block, *key)
            self._planned.add(block)
            kept = position + 1
        return Admission(kept, len(chain))

    def _set(self, block: int, next_use: int, position: int) -> None:
        self._key[block] = (next_use, position)
        heapq.heappush(self._heap, (-next_use, -position, block))

    def _farthest(self) -> tuple[int, tuple[int, int]]:
        heap = self._heap
        while True:
            negative_next, negative_position, block = heap[0]
            key = (-negative_next, -negative_position)
            if self._key.get(block) == key:
                return block, key
            heapq.heappop(heap)

    def stats(self) -> dict[str, JsonValue]:
        return {
            "reads_the_future": True,
            "chained": self._chained,
            "bypassed_blocks": self.bypassed,
            "never_used_again_blocks": self.never_used_again,
            "evicted_blocks": self.evicted,
        }
