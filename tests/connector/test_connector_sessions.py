"""What the scheduler side measures of a session's turns (no engine): churn, and the prompt read
as the context the turn compiled (its blocks, and those the previous prompt did not hold)."""

from __future__ import annotations

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.connector.tenancy import TenantResolver


def blocks(*names: str) -> tuple[bytes, ...]:
    return tuple(name.encode().ljust(16, b"\0") for name in names)


def test_a_turn_counts_its_blocks_and_those_its_session_did_not_hold() -> None:
    scheduler = KVCIScheduler(
        config=KVCIConfig(), block_size=32, slot_bytes=1024, namespace=b"n" * 32,
        secret=b"s" * 32, tp_size=1, tenants=TenantResolver(None), disk=None)
    turn = scheduler._session_turn
    first = turn("s1", blocks("a", "b", "c"))
    assert (first["retrieved_items"], first["novel_items"]) == (3, 3)  # a new context: all new
    assert (first["turns_since_change"], first["context_rewrites"]) == (0, 0)
    grown = turn("s1", blocks("a", "b", "c", "d", "e"))
    assert (grown["retrieved_items"], grown["novel_items"]) == (5, 2)
    assert (grown["turns_since_change"], grown["context_rewrites"]) == (1, 0)
    rewritten = turn("s1", blocks("a", "x", "c", "d"))  # diverges at the second block
    assert (rewritten["retrieved_items"], rewritten["novel_items"]) == (4, 3)
    assert (rewritten["turns_since_change"], rewritten["context_rewrites"]) == (0, 1)
    truncated = turn("s1", blocks("a", "x"))
    assert (truncated["novel_items"], truncated["context_rewrites"]) == (0, 2)
    other = turn("s2", blocks("a", "x"))  # sessions are apart even on the same blocks
    assert (other["retrieved_items"], other["novel_items"]) == (2, 2)


def _request(req_id: str, tenant: str, tokens: list[int]):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
        num_tokens=len(tokens), num_output_tokens=0, lora_request=None, cache_salt=None,
        prompt_embeds=None, mm_features=None,
        kv_transfer_params={"kvci": {"tenant": tenant, "session_id": "run-1"}})


def test_two_tenants_naming_one_session_never_share_its_turns() -> None:
    scheduler = KVCIScheduler(
        config=KVCIConfig(), block_size=32, slot_bytes=1024, namespace=b"n" * 32,
        secret=b"s" * 32, tp_size=1, tenants=TenantResolver(None), disk=None)

    def observe(req_id: str, tenant: str, tokens: list[int]):
        request = _request(req_id, tenant, tokens)
        return scheduler._observation(request, scheduler._state(request))

    observe("a1", "acme", list(range(2, 66)))
    grown = observe("a2", "acme", list(range(2, 98)))
    assert (grown.turns_since_change, grown.context_rewrites) == (1, 0)
    # globex's "run-1" is its own first turn, not a rewrite of acme's.
    first = observe("g1", "globex", list(range(500, 564)))
    assert (first.turns_since_change, first.context_rewrites, first.novel_items) == (0, 0, 2)
    again = observe("a3", "acme", list(range(2, 130)))
    assert (again.turns_since_change, again.context_rewrites) == (2, 0)
