"""A reply tells its caller its own figures: the cache gate's hit-rate window counts every
tenant's lookups, so the reply's gate decision leaves those counts out (the rule and whether it
paused still say why)."""

from __future__ import annotations

import json

from kvci_plugin.connector.reply import gate_reply
from kvci_plugin.worthiness import CacheGate
from kvci_plugin.worthiness.cache_gate import ENGINE_WIDE_INPUTS


def test_the_gates_engine_wide_hit_rate_window_is_not_in_a_reply() -> None:
    gate = CacheGate(hit_rate_floor=0.5, hit_rate_window=10, min_lookups=2)
    for hit in (True, False, False, False):  # other tenants' lookups
        gate.record_lookup(hit)
    decision = gate.decide()
    assert decision.rule.value == "hit_rate_floor" and decision.inputs["lookups"] == 4
    reply = gate_reply(decision, None)
    assert reply is not None and (reply["allow"], reply["rule"]) == (False, "hit_rate_floor")
    text = json.dumps(reply)
    assert all(f'"{name}"' not in text for name in ENGINE_WIDE_INPUTS)
    assert reply["inputs"]["floor"] == 0.5  # the rule's own settings stay
