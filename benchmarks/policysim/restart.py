"""kvci restarted halfway through a trace: learning afresh, or from its policy state file.

``kvci-restarted`` replays the connector's default RAM tier (``KVCITier``) up to the trace's
middle request, then a fresh one for the rest, as an engine restart leaves it: its RAM empty and
its policy knowing nothing of the workload. ``kvci-restarted-warm`` restarts the same way with
``policy_state_file`` set: the first tier's policy is saved through the product's
``PolicyStateFile`` (a real file) and the second starts from what it reads back. Both count the
whole trace and differ only after the restart; LRU, the column they are read against, is not
restarted, so both read low against it, and the difference between the two is what the state
file is worth.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from pydantic import JsonValue

from benchmarks.policysim.admission import StoreEverything
from benchmarks.policysim.block_cache import BlockCache
from benchmarks.policysim.engine_view import EngineView
from benchmarks.policysim.kvci_tier import KVCITier
from benchmarks.policysim.lru_cache import LRUBlockCache
from benchmarks.policysim.replay import Tally, replay
from benchmarks.policysim.sessions import RequestContext
from benchmarks.policysim.trace import TraceRequest
from kvci_plugin.policy import PolicyStateFile, ValuePolicy

NAME = "kvci-restarted"
WARM_NAME = "kvci-restarted-warm"
LRU_NAME = "lru-restarted"


def replay_restarted(
    requests: list[TraceRequest],
    contexts: list[RequestContext],
    make_tier: Callable[[ValuePolicy], KVCITier],
    *,
    warm: bool,
) -> tuple[Tally, dict[str, JsonValue]]:
    """The trace through a tier that restarts at its middle request; ``warm``: through the state
    file. Returns the tally, where the restart fell, what was saved after it and the second
    tier's own stats."""
    middle = _middle(requests, contexts)
    tally = Tally()
    before = make_tier(ValuePolicy())
    for request, context in zip(requests[:middle], contexts[:middle]):
        before.step(request, context, tally)
    hazard = None
    if warm:
        with tempfile.TemporaryDirectory() as folder:
            state = PolicyStateFile(Path(folder) / "policy_state.json")
            learned = before.index.policy_learned()
            assert learned is not None  # a ValuePolicy learns
            state.save(learned)
            hazard = state.load()
    after = make_tier(ValuePolicy(hazard=hazard))
    saved_before = tally.saved_tokens
    for request, context in zip(requests[middle:], contexts[middle:]):
        after.step(request, context, tally)
    return tally, {
        "restart_at_request": middle,
        "saved_tokens_after_restart": tally.saved_tokens - saved_before,
        "after_restart": after.stats(),
    }


def replay_lru_restarted(
    requests: list[TraceRequest],
    contexts: list[RequestContext],
    capacity_blocks: int,
    disk: BlockCache | None = None,
    engine: EngineView | None = None,
) -> tuple[Tally, dict[str, JsonValue]]:
    """Keep-everything LRU restarted at the same request: an empty RAM tier (and engine cache)
    for the second half; ``disk`` is kept. Returns the tally and, as ``replay_restarted``'s,
    where the restart fell and what was saved after it."""
    middle = _middle(requests, contexts)
    halves = [
        replay(
            requests[part],
            contexts[part],
            StoreEverything(LRU_NAME),
            LRUBlockCache(capacity_blocks),
            disk,
            engine,
        )
        for part in (slice(None, middle), slice(middle, None))
    ]
    tally = Tally(
        **{f.name: sum(getattr(t, f.name) for t in halves) for f in dataclasses.fields(Tally)}
    )
    return tally, {
        "restart_at_request": middle,
        "saved_tokens_after_restart": halves[1].saved_tokens,
    }


def _middle(requests: list[TraceRequest], contexts: list[RequestContext]) -> int:
    if len(requests) != len(contexts):
        raise ValueError(f"{len(requests)} requests but {len(contexts)} contexts")
    return len(requests) // 2
