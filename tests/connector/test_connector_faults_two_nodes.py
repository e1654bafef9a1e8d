"""Two nodes on one PostgreSQL catalog: a fault of node A's never stops node B.

Node A (tests/connector/fault_node.py, its own process) persists one prompt after another, its
blobs in a Redis of its own; node B (this process's engine) serves tenant globex, its blobs in
another Redis. So the only path from A's fault to B is the catalog they share, where every
catalog write of either node holds the catalog's one advisory lock. (With one Redis for both,
B's own waits on the frozen server would degrade B's tier before any lock mattered: the
single-node freeze test covers that.) B serves a tenant A never writes, and persists only after
A's start-up reconciliation, which drops the rows of its namespace whose blobs its own store
lacks.

When A's Redis is frozen (SIGSTOP), A's writes hang on it, some inside a catalog transaction (a
record checks its blobs, an abandoned write deletes them, holding the lock): B, persisting and
looking up all the while, must keep completing its requests with the output of recomputing, each
within a bound (B's lock and statement timeouts, set through `timeouts`), as it did beside a
busy A before the fault (the control). A's own engine must survive and serve on after the thaw,
and B's persisted prompt is served from disk again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest
from durable_support import READY, session_token, shared_catalog_ids
from fault_support import (
    ModuleEngine,
    assert_alive,
    assert_baseline,
    base_fixture,
    no_hang_fixture,
    persisted_to_disk,
    send,
    shared_extra,
    wait_for_disk_hit,
)

from tools.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.engine

NODE = Path(__file__).with_name("fault_node.py")
KEPT = "kept15"
FROZEN_S = 12.0  # A's Redis stays frozen this long
B_TIMEOUTS = {"connect_s": 1.0, "statement_s": 0.5, "lock_s": 0.25, "blob_s": 0.5}
"""Node B's bounds on the catalog (kv_connector_extra_config `timeouts`): its engine step waits
at most statement_s + lock_s on any catalog call, under the second after which vLLM's idle
worker may miss its wake-up and sleep 5 s (a stall of vLLM's own that would blur the bound)."""
B_REQUEST_BOUND_S = 3.0
"""A request of B's while A is stuck returns within this. Waiting on A's catalog lock until A's
Redis client gives up on the frozen server (5 s a call) took 4-5 s here."""


class NodeA:
    """Node A's process, its stdout read on a thread: READY, then a `DONE n s` per request."""

    def __init__(self, root: Path, model: Path, extra: dict) -> None:
        (root / "extra.json").write_text(json.dumps(extra))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen([sys.executable, str(NODE), str(root), str(model)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, start_new_session=True)
        self.ready = threading.Event()
        self.done: list[tuple[float, int]] = []  # (when, n) of each completed request
        self.tail: deque[str] = deque(maxlen=60)  # its last lines (vLLM and kvci log to stdout)
        self._reader = threading.Thread(target=self._read, name="node A stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip()[:300])
            if line.startswith(READY):
                self.ready.set()
            elif match := re.match(r"DONE (\d+) ", line):
                self.done.append((time.monotonic(), int(match.group(1))))

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None:
                pytest.fail(f"node A exited ({self.proc.returncode}) before READY")
            if time.monotonic() > deadline:
                pytest.fail("node A did not start")

    def completed_since(self, t: float) -> int:
        return sum(1 for when, _ in self.done if when > t)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode


base = base_fixture()
no_hang = no_hang_fixture(300)


@pytest.fixture(scope="module")
def nodes(tiny_model, base, tmp_path_factory):
    with PostgresServer() as pg, RedisServer() as redis_a, RedisServer() as redis_b:
        catalog = pg.new_database()
        root_a = tmp_path_factory.mktemp("faults-node-a")
        extra_a = shared_extra(root_a, catalog, redis_a.url)
        root_b = tmp_path_factory.mktemp("faults-node-b")
        extra_b = shared_extra(root_b, catalog, redis_b.url, timeouts=B_TIMEOUTS)
        node_a = NodeA(root_a, tiny_model, extra_a)  # starts while B's engine starts
        engine_b = None
        try:
            engine_b = ModuleEngine(tiny_model, extra_b, base)
            # B persists only once A has started: a start-up reconciliation drops the rows of
            # its namespace whose blobs its own store lacks (B's are in B's Redis).
            node_a.wait_ready()
            persisted_to_disk(engine_b.llm, root_b, [KEPT], base,
                              lambda: shared_catalog_ids(catalog), tenant="globex",
                              what="B's persisted checkpoint reaching the catalog")
            yield node_a, engine_b, redis_a, root_b
        finally:
            node_a.stop()
            if engine_b is not None:
                engine_b.close()


def _b_traffic(llm, base, token: str, seconds: float) -> list[tuple[str, float]]:
    """B's requests for `seconds`: a persist (a catalog write under the lock every node
    shares), a disk hit of B's own persisted prompt and a miss (catalog reads), in turn; each
    checked against the baseline; (name, seconds) of each."""
    took: list[tuple[str, float]] = []
    began, i = time.monotonic(), 0
    while time.monotonic() - began < seconds:
        fresh = f"fresh{11 + i % 5}"
        for name, kvci in ((fresh, dict(session_token=token, persist=True,
                                        source_ids=["doc:handbook"])), (KEPT, {}), ("fresh0", {})):
            t = time.monotonic()
            out = send(llm, name, B_REQUEST_BOUND_S * 2, tenant="globex", **kvci)
            took.append((name, time.monotonic() - t))
            assert_baseline(out, name, base)
        i += 1
    return took


def _slow(took: list[tuple[str, float]]) -> list[tuple[str, float]]:
    return [(n, round(s, 1)) for n, s in took if s > B_REQUEST_BOUND_S]


def test_a_frozen_redis_on_node_a_does_not_stop_node_b(nodes, base):
    node_a, engine_b, redis_a, root_b = nodes
    llm = engine_b.alive()
    token = session_token(root_b, tenant="globex")
    started = time.monotonic()
    while node_a.completed_since(started) < 3:  # A is busy writing
        assert node_a.proc.poll() is None, "node A died before the fault"
        assert time.monotonic() - started < 60, "node A completes no request"
        time.sleep(0.2)
    # The control: B's traffic beside a busy A, no fault. (Should this fail, the machine is too
    # loaded for the bound to mean anything.)
    control = _b_traffic(llm, base, token, FROZEN_S / 2)
    assert not _slow(control), f"B was slow with no fault at all: {_slow(control)}"

    redis_a.freeze()
    frozen = time.monotonic()
    try:
        took = _b_traffic(llm, base, token, FROZEN_S)
    finally:
        redis_a.thaw()
    thawed = time.monotonic()
    print(f"B served {len(took)} requests while A's Redis was frozen (slowest "
          f"{max(s for _, s in took):.1f} s; {len(control)} before, slowest "
          f"{max(s for _, s in control):.1f} s); A completed requests at "
          f"{[round(w - frozen, 1) for w, _ in node_a.done if frozen < w < thawed]} s")
    assert not _slow(took), f"node B's requests waited on node A's fault: {_slow(took)}"

    wait_for_disk_hit(llm, KEPT, base, tenant="globex")
    assert_alive(llm, base)
    # A survived its own fault, and serves on.
    deadline = time.monotonic() + 60
    while node_a.completed_since(thawed) < 2:
        assert node_a.proc.poll() is None, \
            f"node A died ({node_a.proc.returncode}):\n" + "\n".join(node_a.tail)
        assert time.monotonic() < deadline, \
            "node A completes no request after the thaw:\n" + "\n".join(node_a.tail)
        time.sleep(0.2)
