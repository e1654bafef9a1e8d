"""Windows staged during prefill (#47) without an engine: the planner against a fake
`kv_connector_block_state`, a real RAM index and the connector's mover. A boundary is staged in
the step whose chunk reaches it, from the block ids vLLM's tables hold then; a null id means the
window has left (counted, never copied); pages staged once are not staged again; a stage is
committed when every rank copied it, dropped when one failed, kept by the request's checkpoint
and dropped at its end either way; a stage that does not fit without evicting is skipped."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.groups import GroupLayout, KVGroup
from kvci_plugin.connector.jobs import WorkerReport
from kvci_plugin.connector.keep import with_windows
from kvci_plugin.connector.mover import ConnectorMover
from kvci_plugin.connector.request_state import RequestState
from kvci_plugin.connector.window_stages import WindowStages
from kvci_plugin.tiering.ram.index import RAMIndex

BS = 32
LAYOUT = GroupLayout((KVGroup(("f",)), KVGroup(("s",), 64)), BS)  # window: 2 blocks
PROMPT = 16 * BS + 5  # boundaries 8 and 16


@dataclass
class _Counts:
    counts: dict[str, float] = field(default_factory=dict)

    def count(self, name: str, n: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def gauge(self, name: str, value: float) -> None:
        pass


class _Requests:
    block_size = BS
    generation = 0

    def __init__(self) -> None:
        self.reqs: dict[str, RequestState] = {}

    def get(self, req_id: str) -> RequestState | None:
        return self.reqs.get(req_id)

    def group_keys(self, st: RequestState) -> list[list[bytes]]:
        if st.group_keys is None:
            st.group_keys = LAYOUT.group_keys(st.keys)
        return st.group_keys


class _Tables:
    """vLLM's current block table of each group, per request (`KVConnectorBlockState`)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[list[int]]] = {}

    def get_block_ids(self, req_id: str) -> list[list[int]]:
        return self.ids[req_id]


def _tables(first_live: int, upto: int, base: int = 100) -> list[list[int]]:
    """A full group's ids for blocks [0, upto) and a sliding one's, null before ``first_live``."""
    return [[base + i for i in range(upto)],
            [0 if i < first_live else base + 50 + i for i in range(upto)]]


def _output(tables: _Tables, scheduled: dict[str, tuple[int, int]]) -> Any:
    """A step: each request's (computed before it, scheduled tokens)."""
    return SimpleNamespace(
        kv_connector_block_state=tables,
        num_scheduled_tokens={r: n for r, (_, n) in scheduled.items()},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(scheduled), num_computed_tokens=[c for c, _ in scheduled.values()]))


@pytest.fixture
def parts():
    requests, counts, mover = _Requests(), _Counts(), ConnectorMover()
    index = RAMIndex(num_slots=64, slot_bytes=16, max_entries=16)
    stages = WindowStages(config=KVCIConfig(ram_bytes=64 * 16), requests=requests, index=index,
                          mover=mover, layout=LAYOUT, stats=counts, tp_size=1)
    return SimpleNamespace(requests=requests, counts=counts, mover=mover, index=index,
                           stages=stages, tables=_Tables())


def _begin(parts, req_id: str = "r", tenant: str = "t", tag: bytes = b"a",
           **params: Any) -> RequestState:
    keys = [tag + bytes([i]) * 15 for i in range(PROMPT // BS)]
    p = SimpleNamespace(opted_out=False, explicit_trigger=None, **params) if params else None
    st = RequestState(params=p, error=None, tenant=tenant, key_tenant=tenant, keys=keys,
                      pool=tenant, prompt_tokens=PROMPT)
    parts.requests.reqs[req_id] = st
    parts.stages.begin(req_id, st)
    return st


def _copied(parts, *, failed: bool = False) -> None:
    """The workers ran this step's window stores (or one failed)."""
    jobs = parts.mover.take_windows()
    report = WorkerReport(window_failed=[j.checkpoint_id for j in jobs]) if failed else \
        WorkerReport(window_stored={j.checkpoint_id: 1 for j in jobs})
    parts.stages.reported(report)


def test_each_boundary_is_staged_in_the_step_whose_chunk_reaches_it(parts) -> None:
    st = _begin(parts)
    gk = parts.requests.group_keys(st)
    # Step 1 computes [0, 192): no boundary reached.
    parts.tables.ids["r"] = _tables(0, 6)
    parts.stages.plan(_output(parts.tables, {"r": (0, 192)}))
    assert parts.mover.window_stores == []
    # Step 2 computes [192, 320): boundary 8 (256 tokens); its window is blocks 6, 7.
    parts.tables.ids["r"] = _tables(4, 10)
    parts.stages.plan(_output(parts.tables, {"r": (192, 128)}))
    (job,) = parts.mover.window_stores
    assert job.req_id == "r" and job.block_ids == [156, 157] and job.groups == [1, 1]
    assert parts.index.absent([gk[1][6], gk[1][7]]) == ()
    # Pending: held (a checkpoint may take it), loadable once copied.
    assert parts.stages.windows("r", 16) == {gk[1][6], gk[1][7]}
    assert parts.index.longest_prefix([gk[1][6], gk[1][7]], "t") == 0
    _copied(parts)
    assert parts.index.longest_prefix([gk[1][6], gk[1][7]], "t") == 2
    # Step 3 computes the rest: boundary 16 (the repeat's and the prompt's end).
    parts.tables.ids["r"] = _tables(8, 17)
    parts.stages.plan(_output(parts.tables, {"r": (320, PROMPT - 320)}))
    (job,) = parts.mover.window_stores
    assert job.block_ids == [164, 165]
    _copied(parts)
    assert parts.stages.windows("r", 16) == {gk[1][i] for i in (6, 7, 14, 15)}
    assert parts.counts.counts[c.WINDOW_STAGES] == 2
    # Decode steps stage nothing more.
    parts.stages.plan(_output(parts.tables, {"r": (PROMPT, 1)}))
    assert parts.mover.window_stores == []


def test_a_window_that_left_the_tables_is_missed_and_never_copied(parts) -> None:
    _begin(parts)
    # A chunk that ends past boundary 8 with its window already null (e.g. inside a hit).
    parts.tables.ids["r"] = _tables(9, 12)
    parts.stages.plan(_output(parts.tables, {"r": (256, 100)}))
    assert parts.mover.window_stores == []
    assert parts.counts.counts[c.WINDOW_BOUNDARIES_MISSED] == 1


def test_a_preempted_request_resumes_at_the_boundaries_not_done(parts) -> None:
    _begin(parts)
    parts.tables.ids["r"] = _tables(4, 10)
    parts.stages.plan(_output(parts.tables, {"r": (0, 300)}))
    _copied(parts)
    # Preempted, recomputed from 0: boundary 8 is done; 16 is staged when reached.
    parts.tables.ids["r"] = _tables(0, 9, base=300)
    parts.stages.plan(_output(parts.tables, {"r": (0, 280)}))
    assert parts.mover.window_stores == []
    parts.tables.ids["r"] = _tables(12, 17, base=300)
    parts.stages.plan(_output(parts.tables, {"r": (280, PROMPT - 280)}))
    (job,) = parts.mover.window_stores
    assert job.block_ids == [364, 365]


def test_the_checkpoint_keeps_the_windows_and_the_stages_go(parts) -> None:
    st = _begin(parts)
    gk = parts.requests.group_keys(st)
    parts.tables.ids["r"] = _tables(4, 17)
    parts.stages.plan(_output(parts.tables, {"r": (0, PROMPT)}))
    _copied(parts)
    # The end's pages: every full block, the sliding group's end window (blocks 18, 19 of 20).
    end = [gk[0][i] for i in range(16)]
    held = parts.stages.windows("r", 16) | set(end)
    keys = with_windows(gk, 16, held)
    assert keys.index(gk[1][6]) == keys.index(gk[0][6]) + 1  # block by block
    parts.index.reserve("final", "t", keys)
    parts.index.commit("final")
    parts.stages.finished("r")
    assert parts.stages.in_flight() == 0 and parts.stages.held_pages == 0
    assert {e.checkpoint_id for e in parts.index.entries()} == {"final"}
    assert parts.index.absent(keys) == ()


def test_a_request_not_kept_or_aborted_leaves_nothing_staged(parts) -> None:
    _begin(parts)
    parts.tables.ids["r"] = _tables(4, 17)
    parts.stages.plan(_output(parts.tables, {"r": (0, 300)}))
    _copied(parts)
    parts.stages.plan(_output(parts.tables, {"r": (300, PROMPT - 300)}))
    parts.stages.finished("r")  # ended while its last copy was in flight
    assert parts.index.stats().pages == 2 and parts.stages.in_flight() == 1
    _copied(parts)  # committed, then dropped
    assert parts.index.stats().pages == 0 and parts.index.entries() == []
    assert parts.stages.in_flight() == 0 and parts.stages.held_pages == 0


def test_a_failed_copy_drops_its_stage(parts) -> None:
    _begin(parts)
    parts.tables.ids["r"] = _tables(4, 10)
    parts.stages.plan(_output(parts.tables, {"r": (0, 300)}))
    _copied(parts, failed=True)
    assert parts.index.entries() == [] and parts.stages.windows("r", 16) == set()
    assert parts.stages.held_pages == 0


def test_a_stage_never_evicts_and_opted_out_requests_stage_nothing(parts) -> None:
    # Another tenant's checkpoint fills the tier: the window is skipped, nothing evicted.
    parts.index.reserve("full", "other", [bytes([200, i]) * 8 for i in range(64)])
    parts.index.commit("full")
    _begin(parts)
    parts.tables.ids["r"] = _tables(4, 10)
    parts.stages.plan(_output(parts.tables, {"r": (0, 300)}))
    assert parts.mover.window_stores == []
    assert parts.counts.counts[c.WINDOW_STAGES_SKIPPED] == 1
    assert [e.checkpoint_id for e in parts.index.entries()] == ["full"]
    st = _begin(parts, "o", tag=b"o")
    st.params = SimpleNamespace(opted_out=True, explicit_trigger=None)
    parts.stages.finished("o")
    parts.stages.begin("o", st)
    parts.tables.ids["o"] = _tables(4, 10)
    parts.stages.plan(_output(parts.tables, {"o": (0, 300)}))
    assert parts.counts.counts.get(c.WINDOW_STAGES, 0) == 0


def test_a_forget_or_reset_meanwhile_is_ignored(parts) -> None:
    _begin(parts)
    parts.tables.ids["r"] = _tables(4, 10)
    parts.stages.plan(_output(parts.tables, {"r": (0, 300)}))
    parts.index.clear()  # a cache reset drops the pending stage
    _copied(parts)
    parts.stages.finished("r")
    assert parts.stages.in_flight() == 0 and parts.stages.held_pages == 0


def test_without_sliding_groups_or_when_off_nothing_is_planned() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=16, max_entries=4)
    for layout, config in ((GroupLayout((KVGroup(("f",)),), BS), KVCIConfig()),
                           (LAYOUT, KVCIConfig(window_stages=False))):
        stages = WindowStages(config=config, requests=_Requests(), index=index,
                              mover=ConnectorMover(), layout=layout, stats=_Counts(), tp_size=1)
        assert not stages.enabled


def test_ranks_reports_of_window_copies_are_summed() -> None:
    a = WorkerReport(window_stored={"w1": 1}, window_failed=["w2"])
    b = WorkerReport(window_stored={"w1": 1, "w3": 1})
    merged = a.merged(b)
    assert merged.window_stored == {"w1": 2, "w3": 1} and merged.window_failed == ["w2"]
    assert not merged.is_empty() and WorkerReport().is_empty()
