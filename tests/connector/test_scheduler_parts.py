"""The scheduler side's parts (no engine): every stats name it counts has a Prometheus series, no
part counts under a name spelled out on the spot, the hit tier reads as its name, and the
persistence gate is the engine's manager's, not installed process-wide."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path
from typing import Any

import pytest

from kvci_plugin.connector import counters, prom
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.request_state import HitTier
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.governance import (
    AlwaysDenyEligibility,
    get_persistence_eligibility_gate,
)
from kvci_plugin.request.tenancy import TenantResolver

CONNECTOR = Path(__file__).resolve().parents[2] / "kvci_plugin" / "connector"
# The scheduler side's parts: each counts through `counters`' names.
PARTS = ("scheduler.py", "keep.py", "lookups.py", "load_plan.py", "worker_report.py",
         "cache_reset.py", "step_stats.py", "reply.py", "control_port.py", "assembly.py",
         "request_state.py", "async_loads.py", "mover.py")


def names() -> dict[str, str]:
    return {k: v for k, v in vars(counters).items() if k.isupper() and isinstance(v, str)}


def test_every_stats_name_has_a_series() -> None:
    series = {*prom._PLAIN, *prom._GAUGES}
    prefixes = {*prom._LABELLED, *prom._LATENCY, counters.TIER_HEALTHY}
    for constant, name in names().items():
        assert name in series or name in prefixes, f"counters.{constant} ({name!r}) has no series"


@pytest.mark.parametrize("module", PARTS)
def test_no_part_counts_under_a_literal_name(module: str) -> None:
    tree = ast.parse((CONNECTOR / module).read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("count", "gauge") and node.args):
            first = node.args[0]
            assert not (isinstance(first, ast.Constant) and isinstance(first.value, str)), (
                f"{module}:{node.lineno}: {first.value!r} — name it in counters.py")


def test_a_hit_tier_reads_as_its_name() -> None:
    assert f"{counters.HIT_TOKENS}{HitTier.DISK}" == "hit_tokens_disk"
    assert str(HitTier.RAM) == "ram" and HitTier.RAM == "ram"


def scheduler(**kwargs: Any) -> KVCIScheduler:
    return KVCIScheduler(config=KVCIConfig(ram_bytes=4 * 1024, ram_policy="lru"), block_size=4,
                         slot_bytes=1024, namespace=hashlib.sha256(b"parts").digest(),
                         secret=b"s" * 32, tp_size=1, tenants=TenantResolver(None), disk=None,
                         **kwargs)


def test_the_gate_is_the_managers_not_the_processs() -> None:
    before = get_persistence_eligibility_gate()
    gate = AlwaysDenyEligibility()
    assert scheduler(gate=gate).manager.gate is gate
    assert get_persistence_eligibility_gate() is before
    assert scheduler().manager.gate is before  # none given: the process-wide one


def test_the_control_port_is_what_the_control_plane_asks_for() -> None:
    from kvci_plugin.api.control import ControlTarget

    port = scheduler().control
    wanted = {name for name in vars(ControlTarget) if not name.startswith("_")}
    assert wanted and all(hasattr(port, name) for name in wanted)


def test_an_arm_keeps_a_digest_of_its_callers_credential_never_the_credential() -> None:
    """Finding 12 of #46: the arm is spent only by the arming caller's requests, and a later
    request cannot persist under the armer's authority (the arm holds no credential)."""
    port = scheduler().control
    port.arm_checkpoint("acme", "s-1", trigger="user", persist=True, session_token="tok-A")
    port.arm_checkpoint("acme", "s-2", trigger="user", persist=False, session_token=None)
    bound, unbound = port._decider.armed[("acme", "s-1")], port._decider.armed[("acme", "s-2")]
    assert not hasattr(bound, "session_token")  # a digest binds it; no credential is kept
    assert bound.bound_to == hashlib.sha256(b"tok-A").hexdigest()
    assert unbound.bound_to is None
