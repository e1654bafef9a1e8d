"""Fault containment on the shared disk tier: a PostgreSQL catalog and a Redis blob store that
fail under a running engine (servers of this module's own, so that faulting them touches no
other test).

Each test injects one fault and restores it in a `finally`: the server terminates kvci's catalog
connections; PostgreSQL is stopped and started again; Redis is stopped and started again; Redis
is frozen (SIGSTOP) for longer than kvci's timeouts; Redis closes kvci's connections. Every
request sent during the fault must complete with the output of recomputing (the no-connector
baseline), the fault is counted on `vllm:kvci_faults{tier="disk"}` (but where the client library
reconnects by itself: a closed Redis connection), and once the dependency answers again a
prompt persisted before the fault is served from disk again within a liveness bound, by the
same engine.

The module's engine persists one prompt per test at start and floods its small LRU RAM tier, so
each of those prompts is held on disk only: a lookup of it asks the catalog, a hit reads Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from durable_support import shared_catalog_ids
from fault_support import (
    ModuleEngine,
    assert_alive,
    assert_baseline,
    base_fixture,
    disk_healthy,
    faults,
    faults_since,
    no_hang_fixture,
    persisted_to_disk,
    send,
    send_disk,
    shared_extra,
    wait_for_disk_hit,
)

from tools.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.engine

KEPT = {"terminated": "kept0", "pg_stopped": "kept1", "redis_stopped": "kept2",
        "redis_frozen": "kept3", "redis_closed": "kept15"}
DURING_BOUND_S = 20.0  # a request sent during a fault returns within this (no hang)
TIMEOUT_S = 2.0  # kvci's default bound on one Redis request (blob_s)
FROZEN_S = 4 * TIMEOUT_S  # Redis stays frozen at least this long
FROZEN_BATCH_BOUND_S = 6 * TIMEOUT_S
"""What the requests sent into a frozen Redis may take together: the first wait ends at kvci's
timeout and degrades the tier, later requests skip it (room is left for one of vLLM's own 5 s
stalls: a worker that idled over a second can miss its wake-up). Waiting on every call until
redis-py's own 5 s socket timeout gives up took 21 s here."""


@dataclass
class Shared:
    engine: ModuleEngine
    pg: PostgresServer
    redis: RedisServer
    catalog_url: str
    root: Path


base = base_fixture()
no_hang = no_hang_fixture(240)


@pytest.fixture(scope="module")
def shared(tiny_model, base, tmp_path_factory):
    with PostgresServer() as pg, RedisServer() as rd:
        root = tmp_path_factory.mktemp("faults-shared")
        catalog_url = pg.new_database()
        with ModuleEngine(tiny_model, shared_extra(root, catalog_url, rd.url), base) as engine:
            persisted_to_disk(engine.llm, root, list(KEPT.values()), base,
                              lambda: shared_catalog_ids(catalog_url))
            yield Shared(engine, pg, rd, catalog_url, root)


def _during(llm: Any, base: dict[str, list[int]], kept: str, fresh: list[str],
            root: Path) -> None:
    """The requests sent while a dependency is down: the persisted prompt (a disk lookup and,
    if the catalog answers, a load), prompts the tier never held (lookups), and a persist (a
    write). Each completes, bounded, with the baseline's output."""
    from durable_support import session_token

    out = send(llm, kept, DURING_BOUND_S, tenant="acme")
    assert_baseline(out, kept, base)
    for name in fresh[:-1]:
        assert_baseline(send(llm, name, DURING_BOUND_S, tenant="acme"), name, base)
    name = fresh[-1]
    out = send(llm, name, DURING_BOUND_S, tenant="acme", session_token=session_token(root),
               persist=True, source_ids=["doc:handbook"])
    assert_baseline(out, name, base)
    # Sent again: the lookup that follows a failure (the tier is skipped or asked again).
    assert_baseline(send(llm, kept, DURING_BOUND_S, tenant="acme"), kept, base)


def _recovered(llm: Any, base: dict[str, list[int]], kept: str) -> None:
    took = wait_for_disk_hit(llm, kept, base)
    print(f"{kept}: served from disk again {took:.1f} s after the dependency answered")
    assert disk_healthy(llm) == 1
    assert_alive(llm, base)


def _counted(llm: Any, before: dict[tuple[str, str], float], kind: str) -> None:
    """The fault was counted on `vllm:kvci_faults{tier="disk", kind}`."""
    assert faults_since(llm, before).get(("disk", kind), 0) >= 1, \
        f"no disk fault of kind {kind} counted: {faults_since(llm, before)}"


def test_catalog_connections_terminated_by_the_server(shared, base):
    llm = shared.engine.alive()
    before = faults(llm)
    # kvci holds the catalog connection it opened at start: the server ends it under the engine.
    assert shared.pg.terminate_connections(shared.catalog_url) >= 1
    _during(llm, base, KEPT["terminated"], ["fresh0", "fresh1"], shared.root)
    _recovered(llm, base, KEPT["terminated"])
    # The connection was idle when it ended: kvci reopens it and runs the first statement again,
    # so nothing failed and the tier never degraded.
    assert faults(llm) == before
    assert disk_healthy(llm) == 1


def _stopped_then_started(shared: Shared, base: dict[str, list[int]],
                          server: PostgresServer | RedisServer, kept: str,
                          fresh: list[str]) -> None:
    """`server` stopped under the engine, then started again: the requests sent meanwhile
    complete, the tier degrades, and once the server answers it serves `kept` from disk again;
    the fault was counted as `unavailable`."""
    llm = shared.engine.alive()
    before = faults(llm)
    server.stop()
    try:
        started = time.monotonic()
        _during(llm, base, kept, fresh, shared.root)
        while time.monotonic() - started < 3.0:  # down for a while: probes fail too
            assert_baseline(send(llm, fresh[0], tenant="acme"), fresh[0], base)
        assert disk_healthy(llm) == 0  # degraded while the dependency is down
    finally:
        if not server.running:
            server.start()
    _recovered(llm, base, kept)
    _counted(llm, before, "unavailable")


def test_postgres_stopped_then_started_again(shared, base):
    _stopped_then_started(shared, base, shared.pg, KEPT["pg_stopped"], ["fresh2", "fresh3"])


def test_redis_stopped_then_started_again(shared, base):
    _stopped_then_started(shared, base, shared.redis, KEPT["redis_stopped"], ["fresh4", "fresh5"])


def test_redis_frozen_longer_than_the_timeout(shared, base):
    llm = shared.engine.alive()
    before = faults(llm)
    shared.redis.freeze()
    try:
        frozen = time.monotonic()
        # The requests return while Redis is still frozen: kvci's waits are bounded, and once
        # one has timed out the tier is skipped instead of waited on again.
        _during(llm, base, KEPT["redis_frozen"], ["fresh6", "fresh7"], shared.root)
        took = time.monotonic() - frozen
        assert took < FROZEN_BATCH_BOUND_S, f"requests waited {took:.1f} s on a frozen Redis"
        while time.monotonic() - frozen < FROZEN_S:
            assert_baseline(send(llm, "fresh6", DURING_BOUND_S, tenant="acme"), "fresh6", base)
        assert disk_healthy(llm) == 0
    finally:
        shared.redis.thaw()
    _recovered(llm, base, KEPT["redis_frozen"])
    _counted(llm, before, "timeout")


def test_redis_connections_closed_by_the_server(shared, base):
    llm = shared.engine.alive()
    send_disk(llm, KEPT["redis_closed"], base)  # kvci has blob connections open
    assert shared.redis.terminate_connections() >= 1
    _during(llm, base, KEPT["redis_closed"], ["fresh8", "fresh9"], shared.root)
    _recovered(llm, base, KEPT["redis_closed"])
