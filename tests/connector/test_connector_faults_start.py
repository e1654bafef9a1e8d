"""An engine starts while its disk tier's PostgreSQL catalog is down: it serves from RAM (every
output the baseline's), a persist is reported failed because the tier is unavailable (not refused),
the tier reads unhealthy — and once PostgreSQL answers, the same engine attaches the tier by itself:
a persist is recorded and its prompt is served from disk."""

from __future__ import annotations

import time

import pytest
from durable_support import session_token, shared_catalog_ids
from fault_support import (
    RECOVERY_BOUND_S,
    ModuleEngine,
    assert_alive,
    assert_baseline,
    base_fixture,
    disk_healthy,
    evict_to_disk,
    hang_guard,
    send,
    shared_extra,
    step_until,
    wait_healthy,
)

from tools.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.engine

base = base_fixture()


def _persist(llm, root, name):
    reply = send(llm, name, tenant="acme", session_token=session_token(root), persist=True,
                 source_ids=["doc:handbook"]).kv_transfer_params["kvci"]
    return reply["persist"], reply["checkpoint_id"]


def test_an_engine_started_with_its_catalog_down_attaches_the_disk_tier_when_it_answers(
        tiny_model, base, tmp_path):
    with hang_guard(300), PostgresServer() as pg, RedisServer() as rd:
        extra = shared_extra(tmp_path, pg.new_database(), rd.url)
        pg.stop()
        engine = ModuleEngine(tiny_model, extra, base)  # must start
        try:
            llm = engine.llm
            for name in ("fresh0", "fresh1"):
                assert_baseline(send(llm, name, tenant="acme"), name, base)
            persist, _ = _persist(llm, tmp_path, "kept20")
            assert persist["status"] == "failed" and "unavailable" in persist["reason"], persist
            assert disk_healthy(llm) == 0
            assert_alive(llm, base)

            pg.start()
            answered = time.monotonic()
            wait_healthy(llm)
            persist, cid = _persist(llm, tmp_path, "kept21")
            assert persist["status"] in ("persisting", "persisted"), persist
            print(f"disk tier attached {time.monotonic() - answered:.1f} s after PostgreSQL "
                  "answered")
            step_until(llm, lambda: cid in shared_catalog_ids(extra["catalog_url"]),
                       "the persist reaching the catalog")
            evict_to_disk(llm, tmp_path, ["kept21"], base)  # served from the attached disk tier
            assert time.monotonic() - answered < RECOVERY_BOUND_S + 60
            assert engine.restarts == 0
            assert_alive(llm, base)
        finally:
            engine.close()
