"""The `kvci.retain` action of vLLM's KV hints, read (#49): an order with a TTL and a priority,
version "1"; anything else is ignored and named, never raised."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvci_plugin.request.hints import read_kv_hints
from kvci_plugin.request.retain_hint import RETAIN_ACTION, RetainHint, retain_hint


def hints(*actions: dict[str, Any]) -> Any:
    """A request carrying an envelope of these actions (plain dicts, as msgspec's are read)."""
    return read_kv_hints(SimpleNamespace(kv_hints={
        "protocol_version": "1", "message_id": "m", "actions": list(actions)}))


def action(payload: Any, *, action_id: str = "a", action_type: str = RETAIN_ACTION,
           version: str = "1") -> dict[str, Any]:
    return {"action_id": action_id, "action_type": action_type, "action_version": version,
            "payload": payload}


def test_a_retention_order_is_read_with_its_ttl_and_priority() -> None:
    order, problems = retain_hint(hints(action({"ttl_s": 30, "priority": 5})))
    assert order == RetainHint(ttl_s=30.0, priority=5, action_id="a") and problems == ()


def test_priority_defaults_to_zero() -> None:
    order, _ = retain_hint(hints(action({"ttl_s": 1.5})))
    assert order is not None and order.priority == 0 and order.ttl_s == 1.5


def test_no_envelope_and_no_retention_action_order_nothing() -> None:
    assert retain_hint(None) == (None, ())
    assert retain_hint(hints(action({"blocks": [1]}, action_type="prefetch"))) == (None, ())


def test_the_highest_priority_is_taken_the_first_of_equals() -> None:
    order, _ = retain_hint(hints(action({"ttl_s": 1, "priority": 2}, action_id="low"),
                                 action({"ttl_s": 2, "priority": 9}, action_id="high"),
                                 action({"ttl_s": 3, "priority": 9}, action_id="later")))
    assert order is not None and order.action_id == "high" and order.ttl_s == 2.0


@pytest.mark.parametrize("payload", [
    {}, {"ttl_s": 0}, {"ttl_s": -3}, {"ttl_s": "30"}, {"ttl_s": True}, {"ttl_s": None},
    {"ttl_s": float("inf")}, {"ttl_s": float("nan")}, {"ttl_s": 5, "priority": -1},
    {"ttl_s": 5, "priority": 101}, {"ttl_s": 5, "priority": 1.5}, {"ttl_s": 5, "pin": True},
])
def test_a_bad_payload_is_ignored_and_named(payload: dict[str, Any]) -> None:
    order, problems = retain_hint(hints(action(payload, action_id="x")))
    assert order is None
    assert len(problems) == 1 and "'x'" in problems[0] and "bad payload" in problems[0]


def test_an_unknown_version_is_ignored_and_named() -> None:
    order, problems = retain_hint(hints(action({"ttl_s": 5}, version="2")))
    assert order is None and "version '2' unknown" in problems[0]


def test_a_bad_action_beside_a_good_one_leaves_the_good_one() -> None:
    order, problems = retain_hint(hints(action({"ttl_s": "x"}, action_id="bad"),
                                        action({"ttl_s": 4}, action_id="good")))
    assert order is not None and order.action_id == "good" and len(problems) == 1


def test_an_unreadable_envelope_orders_nothing() -> None:
    assert retain_hint(read_kv_hints(SimpleNamespace(kv_hints=42))) == (None, ())
