"""Erasure that erases, on real engines: two nodes (this process's engine, node 1, and another
process's, node 2) share a PostgreSQL catalog and a Redis blob store. Tenant acme persists,
retains and checkpoints on node 1 and checkpoints on node 2 (which also serves node 1's persisted
KV from disk); then the control surface forgets acme while one of its persists is in flight.
Afterwards no request of acme hits any of that KV on either node, no catalog row of acme is
left, its key material in the blob store is a tombstone, and a restarted engine finds nothing.

Run as a script, this module is node 2: it serves the requests written to its stdin, one JSON
line each, and prints each reply.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_support import (  # noqa: E402
    READY,
    session_token,
    setup_dirs,
    shared_catalog_ids,
    start_node,
)
from fault_support import ENGINE, PROMPTS, ModuleEngine, send, step_until  # noqa: E402

pytestmark = pytest.mark.engine

SYNC_BOUND_S = 5.0
"""Node 2 learns of node 1's forget within ERASURE_SYNC_S (one second); the bound's margin is for
a loaded machine."""
PERSISTED, RETAINED, CHECKPOINTED, ON_NODE_2 = "kept0", "kept1", "kept2", "kept3"
# Persists sent until the forget catches one in flight (a persist can finish between two of the
# racer's polls): each a prompt of its own, so that each is a new write.
IN_FLIGHT_TRIES = [f"kept{i}" for i in range(4, 12)]
REPLY = "REPLY "


class Node2:
    """The other node's process: one request per line written, one REPLY line read."""

    def __init__(self, root: Path, model: Path, extra: dict[str, Any]) -> None:
        self.proc, _ = start_node(Path(__file__), root, model, extra)

    def send(self, name: str, **kvci: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"name": name, "kvci": kvci}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        pytest.fail(f"node 2 exited ({self.proc.wait(30)})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture(scope="module")
def nodes(tiny_model, tmp_path_factory):
    from server import free_port

    from tools.servers import PostgresServer, RedisServer

    with PostgresServer() as pg, RedisServer() as redis:
        root = tmp_path_factory.mktemp("erasure")
        # One state_dir for both: every node sharing a disk tier needs the same secret (its
        # page keys and its root key).
        extra = setup_dirs(root)
        del extra["disk_root"]
        extra.update(catalog_url=pg.new_database(), blob_url=redis.url)
        port = free_port()
        node1 = ModuleEngine(tiny_model, {**extra, "control_port": port}, {})
        node2 = None
        try:
            node2 = Node2(root, tiny_model, extra)
            yield node1, node2, root, extra, f"http://127.0.0.1:{port}"
        finally:
            if node2 is not None:
                node2.stop()
            node1.close()


def _control(url: str, root: Path, request: dict[str, Any]) -> dict[str, Any]:
    from kvci_plugin.api.client import ControlClient

    with ControlClient(url, token_file=root / "state" / "control-operator.token",
                       timeout_s=30) as control:
        return control.call(request)


def _forget(url: str, root: Path) -> dict[str, Any]:
    token = session_token(root, scopes=["kv:persist", "kv:forget"])
    return _control(url, root, {"action": "forget", "tenant": "acme", "session_token": token})


def _acme_rows(catalog_url: str) -> tuple[int, int]:
    import psycopg

    with psycopg.connect(catalog_url) as conn:
        return tuple(conn.execute(  # type: ignore[return-value]
            "SELECT (SELECT count(*) FROM checkpoints WHERE tenant = 'acme'),"
            " (SELECT count(*) FROM pages WHERE tenant = 'acme')").fetchone())


def _material(extra: dict[str, Any]) -> bytes | None:
    from kvci_plugin.tiering.blobs.factory import open_blob_root
    from kvci_plugin.tiering.blobs.tenant_keys import StateDirRootKey

    blobs = open_blob_root(extra["blob_url"], None, StateDirRootKey(Path(extra["state_dir"])))
    try:
        keys = blobs.keys
        return keys._materials.read_material(keys.tenant_id("acme"))
    finally:
        blobs.close()


def _cached(llm: Any, name: str, tenant: str = "acme") -> int:
    out = send(llm, name, tenant=tenant)
    return out.num_cached_tokens


def test_a_forget_erases_everything_everywhere(nodes, tiny_model) -> None:
    from kvci_plugin.tiering.blobs.tenant_keys import TOMBSTONE

    node1, node2, root, extra, url = nodes
    llm = node1.llm
    token = session_token(root)
    # acme persists on node 1, retains and checkpoints there, and checkpoints on node 2.
    kept = send(llm, PERSISTED, tenant="acme", session_token=token, persist=True,
                source_ids=["doc:handbook"]).kv_transfer_params["kvci"]
    step_until(llm, lambda: kept["checkpoint_id"] in shared_catalog_ids(extra["catalog_url"]),
               "the persisted checkpoint reaching the catalog")
    retained = send(llm, RETAINED, tenant="acme", session_id="s1",
                    retain={"ttl_s": 300.0}).kv_transfer_params["kvci"]
    assert (retained.get("retain") or {}).get("status") == "retained", retained
    assert send(llm, CHECKPOINTED, tenant="acme",
                checkpoint="now").kv_transfer_params["kvci"]["tier"] == "ram"
    assert node2.send(ON_NODE_2, tenant="acme", checkpoint="now")["tier"] == "ram"
    for name in (PERSISTED, RETAINED, CHECKPOINTED):  # the set-up: each hits
        assert _cached(llm, name) > 0, name
    assert node2.send(ON_NODE_2, tenant="acme")["cached"] > 0
    # Node 2 finds node 1's persisted KV on the shared disk tier (whether it loads it or
    # recomputes is its load rule's choice).
    assert node2.send(PERSISTED, tenant="acme")["hit_tier"] in ("disk", None)

    # The forget lands while a persist of acme's is in flight on node 1.
    raced: list[Any] = []
    done, caught = threading.Event(), threading.Event()

    def forget_when_in_flight() -> None:
        while not done.is_set():
            if _control(url, root, {"action": "ram_stats"})["stats"]["persists_in_flight"]:
                caught.set()
                raced.append(_forget(url, root))
                return
            time.sleep(0.005)

    racer = threading.Thread(target=forget_when_in_flight, name="forget")
    racer.start()
    sent = []
    try:
        for name in IN_FLIGHT_TRIES:
            sent.append(name)
            send(llm, name, tenant="acme", session_token=token, persist=True,
                 source_ids=["doc:handbook"])
            racer.join(0.5)
            if caught.is_set():  # no further try while (or after) the forget runs
                break
    finally:
        done.set()
        racer.join(90)
    assert raced, f"no persist of acme's was seen in flight in {len(sent)} tries"
    (answer,) = raced
    assert answer["action"] == "forget" and answer["key_destroyed"], answer
    for _ in range(3):  # settle: the in-flight write reports, and is refused
        send(llm, "fresh0")

    # Nothing of acme's hits on node 1, nor (once it has learned of the forget) on node 2.
    acme = [PERSISTED, RETAINED, CHECKPOINTED, ON_NODE_2, *sent]
    assert {name: _cached(llm, name) for name in acme} == dict.fromkeys(acme, 0)
    assert {name: _cached(llm, name, "globex") for name in acme} == dict.fromkeys(acme, 0)
    deadline = time.monotonic() + SYNC_BOUND_S
    while node2.send(ON_NODE_2, tenant="acme")["cached"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {name: node2.send(name, tenant="acme")["cached"] for name in acme} == \
        dict.fromkeys(acme, 0)
    assert _acme_rows(extra["catalog_url"]) == (0, 0)
    assert _material(extra) in (None, TOMBSTONE)  # no key material opens acme's blobs

    # A restart brings nothing back.
    node2.stop()
    node1.close()
    node1.llm = node1._start()
    assert {name: _cached(node1.llm, name) for name in acme} == dict.fromkeys(acme, 0)
    assert _acme_rows(extra["catalog_url"]) == (0, 0)
    assert _material(extra) in (None, TOMBSTONE)


if __name__ == "__main__":  # node 2
    from engine import generate_one, kvci_params, make_llm

    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    extra = json.loads((root / "extra.json").read_text())
    llm = make_llm(model, extra, **ENGINE)
    print(READY + "{}", flush=True)
    for line in sys.stdin:
        asked = json.loads(line)
        out = generate_one(llm, PROMPTS[asked["name"]], kvci_params(**asked["kvci"]))
        kvci = (out.kv_transfer_params or {}).get("kvci") or {}
        print(REPLY + json.dumps({"cached": out.num_cached_tokens, "tier": kvci.get("tier"),
                                  "hit_tier": kvci.get("hit_tier")}), flush=True)
