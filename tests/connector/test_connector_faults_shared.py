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
    PostgresServer,
    RedisServer,
    assert_alive,
    assert_baseline,
    baseline,
    disk_healthy,
    durable_extra,
    evict_to_disk,
    faults,
    faults_since,
    hang_guard,
    persist,
    private_postgres,
    private_redis,
    send,
    send_disk,
    step_until,
    wait_for_disk_hit,
)

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


@pytest.fixture(scope="module")
def base(tiny_model):
    return baseline(tiny_model)


@pytest.fixture(scope="module")
def shared(tiny_model, base, tmp_path_factory):
    with private_postgres() as pg, private_redis() as rd:
        root = tmp_path_factory.mktemp("faults-shared")
        extra = durable_extra(root)
        del extra["disk_root"]  # the blobs live in Redis, the catalog in PostgreSQL
        extra.update(catalog_url=pg.new_database(), blob_url=rd.url)
        engine = ModuleEngine(tiny_model, extra, base)
        try:
            ids = persist(engine.llm, root, list(KEPT.values()))
            step_until(engine.llm,
                       lambda: set(ids.values()) <= shared_catalog_ids(extra["catalog_url"]),
                       "the persisted checkpoints reaching the catalog")
            evict_to_disk(engine.llm, list(KEPT.values()), base)
            yield Shared(engine, pg, rd, extra["catalog_url"], root)
        finally:
            engine.close()


@pytest.fixture(autouse=True)
def no_hang():
    with hang_guard(240):
        yield


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


def test_postgres_stopped_then_started_again(shared, base):
    llm = shared.engine.alive()
    before = faults(llm)
    shared.pg.stop()
    try:
        started = time.monotonic()
        _during(llm, base, KEPT["pg_stopped"], ["fresh2", "fresh3"], shared.root)
        while time.monotonic() - started < 3.0:  # down for a while: probes fail too
            assert_baseline(send(llm, "fresh2", tenant="acme"), "fresh2", base)
        assert disk_healthy(llm) == 0  # degraded while the catalog is down
    finally:
        if not shared.pg.running:
            shared.pg.start()
    _recovered(llm, base, KEPT["pg_stopped"])
    _counted(llm, before, "unavailable")


def test_redis_stopped_then_started_again(shared, base):
    llm = shared.engine.alive()
    before = faults(llm)
    shared.redis.stop()
    try:
        started = time.monotonic()
        _during(llm, base, KEPT["redis_stopped"], ["fresh4", "fresh5"], shared.root)
        while time.monotonic() - started < 3.0:
            assert_baseline(send(llm, "fresh4", tenant="acme"), "fresh4", base)
        assert disk_healthy(llm) == 0
    finally:
        if not shared.redis.running:
            shared.redis.start()
    _recovered(llm, base, KEPT["redis_stopped"])
    _counted(llm, before, "unavailable")


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
