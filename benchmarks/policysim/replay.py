"""Replaying a trace against one policy and one pair of tiers.

Per request: the lookup finds the longest leading run of the chain resident in RAM, then
continues it on disk; the hit saves that many blocks of prefill. A hit covers full blocks only,
and never the prompt's last token (``TraceRequest.hit_blocks``), and a tier holds full blocks
only (``TraceRequest.full_blocks``), whatever a policy admits: an engine keys no partial block
(vLLM's block hashes, and so its native offloading and kvci, cover full blocks) and always
computes the last token. So an exact repeat saves its full blocks, not its whole input, for every
policy alike. Then the policy admits a leading run of the chain to each
tier: resident blocks are left as they are, the others are written. Within a request, blocks
are visited from the last to the first, so the chain's root ends up most recently used and an
LRU evicts a chain from its tail, as vLLM's prefix cache does: a run that lost its root is
worthless.

A write is a block a tier accepted from ``insert``: one the cache declines (an offline bound's
bypass) is not written; one it accepts and later turns away internally (TinyLFU's window victim
refused by its main segment) was written once, when it entered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.policysim.admission import AdmissionPolicy
from benchmarks.policysim.block_cache import BlockCache, leading_run
from benchmarks.policysim.engine_view import EngineCache, EngineView
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest


@dataclass(slots=True)
class Tally:
    requests: int = 0
    input_tokens: int = 0
    requested_blocks: int = 0
    requests_with_hit: int = 0
    ram_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    ram_saved_tokens: int = 0
    disk_saved_tokens: int = 0
    # Served by the engine's own prefix cache in front of the tiers (an engine replay's view).
    engine_saved_tokens: int = 0
    admitted_requests: int = 0
    ram_blocks_written: int = 0
    disk_blocks_written: int = 0

    @property
    def saved_tokens(self) -> int:
        return self.engine_saved_tokens + self.ram_saved_tokens + self.disk_saved_tokens


def replay(
    requests: Sequence[TraceRequest],
    contexts: Sequence[RequestContext],
    policy: AdmissionPolicy,
    ram: BlockCache,
    disk: BlockCache | None = None,
    engine: EngineView | None = None,
) -> Tally:
    if len(requests) != len(contexts):
        raise ValueError(f"{len(requests)} requests but {len(contexts)} contexts")
    tally = Tally()
    front = EngineCache(engine) if engine is not None else None
    for request, context in zip(requests, contexts):
        hittable = request.hash_ids[: request.hit_blocks]
        local = front.lookup(request) if front is not None else 0
        # A tier serves only past what the engine holds, and past what the tier before it served.
        ram_end = max(local, leading_run(ram, hittable))
        disk_end = ram_end + leading_run(disk, hittable, ram_end) if disk is not None else ram_end
        ram_run, disk_run = ram_end - local, disk_end - ram_end
        account_lookup(tally, request, ram_run, disk_run, local)
        # A policy weighs what the tiers saved, as the connector's hit tells it.
        saved = (ram_run + disk_run) * BLOCK_TOKENS

        admission = policy.admit(request, context, saved)
        for tier, blocks in (
            ("ram_blocks", admission.ram_blocks),
            ("disk_blocks", admission.disk_blocks),
        ):
            if not 0 <= blocks <= len(request.hash_ids):
                raise ValueError(
                    f"policy {policy.name!r} admitted {tier}={blocks} of a "
                    f"{len(request.hash_ids)}-block chain"
                )
        chain = request.hash_ids[: request.full_blocks]
        ram_blocks, disk_blocks = (
            min(admission.ram_blocks, len(chain)),
            min(admission.disk_blocks, len(chain)),
        )
        tally.admitted_requests += ram_blocks > 0 or disk_blocks > 0
        tally.ram_blocks_written += _serve(ram, chain, local, ram_end, ram_blocks)
        if disk is not None:
            tally.disk_blocks_written += _serve(disk, chain, ram_end, disk_end, disk_blocks)
        if front is not None:
            front.finished(request)
    return tally


def account_lookup(
    tally: Tally, request: TraceRequest, ram_run: int, disk_run: int, engine_run: int = 0
) -> int:
    """Count a lookup that found ``engine_run`` blocks in the engine's own cache, then ``ram_run``
    in RAM and then ``disk_run`` on disk (within ``request.hit_blocks``); returns the prefill
    tokens it saved."""
    if engine_run + ram_run + disk_run > request.hit_blocks:
        raise ValueError(f"a hit of {engine_run + ram_run + disk_run} blocks exceeds the "
                         f"{request.hit_blocks} a hit can cover")
    ram_saved = ram_run * BLOCK_TOKENS
    disk_saved = disk_run * BLOCK_TOKENS
    engine_saved = engine_run * BLOCK_TOKENS
    saved = engine_saved + ram_saved + disk_saved
    tally.requests += 1
    tally.input_tokens += request.input_length
    tally.requested_blocks += len(request.hash_ids)
    tally.requests_with_hit += saved > 0
    tally.ram_hit_blocks += ram_run
    tally.disk_hit_blocks += disk_run
    tally.ram_saved_tokens += ram_saved
    tally.disk_saved_tokens += disk_saved
    tally.engine_saved_tokens += engine_saved
    return saved


def _serve(
    cache: BlockCache, chain: Sequence[int], hit_start: int, hit_end: int, admitted: int
) -> int:
    """Touch the blocks this tier served, write the admitted ones it lacks; return blocks
    written."""
    served = chain[hit_start:hit_end]
    # Touched first, as a lookup does, so that this request's own writes do not evict them.
    for block in reversed(served):
        cache.touch(block)
    written = 0
    for position in range(admitted - 1, -1, -1):
        block = chain[position]
        if block not in cache:
            written += cache.insert(block)
    if written:
        # Reordered so that the root is more recent than the tail just written.
        for block in reversed(served):
            if block in cache:
                cache.refresh(block)
    return written
