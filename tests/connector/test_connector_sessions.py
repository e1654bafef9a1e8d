"""What the scheduler side measures of a session's turns (no engine): churn, and the prompt read
as the context the turn compiled (its blocks, and those the previous prompt did not hold)."""

from __future__ import annotations

import pytest

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver


def _request(req_id: str, tenant: str, tokens: list[int], **kvci):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
        num_tokens=len(tokens), num_output_tokens=0, lora_request=None, cache_salt=None,
        prompt_embeds=None, mm_features=None, status=SimpleNamespace(name="RUNNING"),
        kv_transfer_params={"kvci": {"tenant": tenant, "session_id": "run-1", **kvci}})


def _observed(scheduler: KVCIScheduler, request, st=None):
    """The observation the keep decision scores for ``request`` as it finishes."""
    st = st or scheduler.requests.state(request)
    finished = scheduler.keeper.finished_request(request, st, [])
    return scheduler.decider.decide(finished).observation


def _scheduler() -> KVCIScheduler:
    return KVCIScheduler(
        config=KVCIConfig(), block_size=32, slot_bytes=1024, namespace=b"n" * 32,
        secret=b"s" * 32, tp_size=1, tenants=TenantResolver(None), disk=None)


def _block(name: int) -> list[int]:
    return [name] * 32


def test_a_turn_counts_its_blocks_and_those_its_session_did_not_hold() -> None:
    scheduler = _scheduler()

    def turn(req_id: str, *names: int, **kvci):
        request = _request(req_id, "acme", [t for n in names for t in _block(n)] + [1], **kvci)
        request.num_output_tokens, request.num_tokens = 3, request.num_tokens + 3
        return _observed(scheduler, request)

    first = turn("r1", 2, 3, 4)
    assert (first.retrieved_items, first.novel_items) == (3, 3)  # a new context: all new
    assert (first.turns_since_change, first.context_rewrites) == (0, 0)
    assert (first.context_tokens, first.output_tokens) == (97, 3)  # the prompt, its output apart
    grown = turn("r2", 2, 3, 4, 5, 6)
    assert (grown.retrieved_items, grown.novel_items) == (5, 2)
    assert (grown.turns_since_change, grown.context_rewrites) == (1, 0)
    rewritten = turn("r3", 2, 9, 4, 5)  # diverges at the second block
    assert (rewritten.retrieved_items, rewritten.novel_items) == (4, 3)
    assert (rewritten.turns_since_change, rewritten.context_rewrites) == (0, 1)
    # The rewrite reached the cache gate's churn rule, under the tenant's session.
    churn = next(
        e for e in scheduler.cache_gate.decide("acme\x1frun-1").evaluated if e.rule.value == "churn"
    )
    assert churn.inputs["changes_in_window"] == 1
    truncated = turn("r4", 2, 9)
    assert (truncated.novel_items, truncated.context_rewrites) == (0, 2)
    # A client's own item counts stand: the engine's blocks are another unit.
    told = turn("r5", 2, 9, 7, observation={"retrieved_items": 40, "novel_items": 1})
    assert (told.retrieved_items, told.novel_items, told.context_rewrites) == (40, 1, 2)


def test_two_tenants_naming_one_session_never_share_its_turns() -> None:
    scheduler = _scheduler()

    def observe(req_id: str, tenant: str, tokens: list[int]):
        request = _request(req_id, tenant, tokens)
        return _observed(scheduler, request)

    observe("a1", "acme", list(range(2, 66)))
    grown = observe("a2", "acme", list(range(2, 98)))
    assert (grown.turns_since_change, grown.context_rewrites) == (1, 0)
    # globex's "run-1" is its own first turn, not a rewrite of acme's.
    first = observe("g1", "globex", list(range(500, 564)))
    assert (first.turns_since_change, first.context_rewrites, first.novel_items) == (0, 0, 2)
    again = observe("a3", "acme", list(range(2, 130)))
    assert (again.turns_since_change, again.context_rewrites) == (2, 0)


def test_the_rebuild_time_is_the_whole_prompt_at_the_measured_prefill_rate() -> None:
    scheduler = _scheduler()
    request = _request("r1", "acme", list(range(2, 98)))
    st = scheduler.requests.state(request)
    assert _observed(scheduler, request, st).wall_time_s is None  # no rate measured yet
    scheduler.load_rule.observe_prefill(64, 0.064)  # a miss: 1 ms a token
    # A hit that computed one token in 0.5 s: its own time scaled up would say 48 s.
    st.first_scheduled, st.prefill_s, st.ext_tokens = 0.0, 0.5, 95
    assert _observed(scheduler, request, st).wall_time_s == pytest.approx(0.096)


def test_a_step_learns_the_prefill_once_and_a_decoding_request_still_ends_its_retentions(
        ) -> None:
    from types import SimpleNamespace

    scheduler = _scheduler()
    request = _request("r1", "acme", list(range(2, 98)))  # 96 tokens: 3 blocks
    st = scheduler.requests.state(request)
    assert st.ends_retention  # its session's turn: scheduled, it ends the session's retentions

    def step(n: int) -> None:
        scheduler._step_bookkeeping(SimpleNamespace(num_scheduled_tokens={"r1": n}))

    step(96)  # the whole prompt: computed by the step's forward
    assert st.prompt_done and not st.ends_retention
    assert scheduler.load_rule.recompute_s(96) is None  # that forward has not run yet
    step(1)  # the next step: the prefill is timed, a recompute rate learned
    assert st.prefill_s is not None
    rate = scheduler.load_rule.recompute_s(96)
    assert rate is not None
    for _ in range(3):  # decoding: nothing more is learned
        step(1)
    assert scheduler.load_rule.recompute_s(96) == rate
    st.ends_retention = True  # asked again (a turn of its session found it running)
    step(1)
    assert not st.ends_retention
