"""`forget` racing the same tenant's traffic on a real engine: the control surface crypto-erases
tenant acme (rows, key material, blobs, RAM checkpoints) while a batch of acme's requests runs
whose lookups found its checkpoints on disk, whose loads read those blobs and whose persists
write new ones. Every request completes with the output of recomputing, every forget answers,
the engine serves on; once the traffic has settled, a last forget leaves nothing of acme: no
catalog row, no RAM page (none left pinned by a write the forget cut short), no hit.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from durable_support import catalog_rows, session_token
from fault_support import (
    ModuleEngine,
    assert_alive,
    assert_baseline,
    base_fixture,
    durable_extra,
    no_hang_fixture,
    persisted_to_disk,
    send,
    send_many,
)
from server import free_port

from kvci_plugin.api.client import ControlClient

pytestmark = pytest.mark.engine

# Each round races its own prompts (what an earlier round left behind cannot mask its set-up).
ROUNDS = [(0.0, ["kept16", "kept17", "kept18", "kept19"]),
          (0.05, ["kept20", "kept21", "kept22", "kept23"]),
          (0.15, ["kept24", "kept25", "kept26", "kept27"])]
"""(when the round's forget lands from its batch's start, the round's prompts)"""


base = base_fixture()
no_hang = no_hang_fixture(300)


@pytest.fixture(scope="module")
def forget_engine(tiny_model, base, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-forget")
    port = free_port()
    with ModuleEngine(tiny_model, durable_extra(root, control_port=port), base) as engine:
        yield engine, root, f"http://127.0.0.1:{port}"


def _forget(url: str, root: Path) -> dict[str, Any]:
    token = session_token(root, scopes=["kv:persist", "kv:forget"])
    with ControlClient(
        url, token_file=root / "state" / "control-operator.token", timeout_s=30
    ) as control:
        return control.call({"action": "forget", "tenant": "acme", "session_token": token})


def _ram_stats(url: str, root: Path) -> dict[str, Any]:
    with ControlClient(
        url, token_file=root / "state" / "control-operator.token", timeout_s=30
    ) as control:
        return control.call({"action": "ram_stats"})["stats"]


def _catalogued_checkpoints(disk: Path, tenant: str) -> int:
    conn = sqlite3.connect(f"file:{disk / 'catalog.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT COUNT(*) FROM checkpoints WHERE tenant = ?",
                            (tenant,)).fetchone()[0]
    finally:
        conn.close()


def test_forget_racing_lookups_loads_and_persists_of_the_same_tenant(forget_engine, base):
    engine, root, url = forget_engine
    llm = engine.alive()
    disk = Path(engine.extra["disk_root"])
    token = session_token(root)
    for delay, race in ROUNDS:
        # After a forget: under fresh key material; each is held on disk only, and served
        # from there.
        persisted_to_disk(llm, root, race, base, lambda: set(catalog_rows(disk)))

        answers: list[object] = []

        # Its thread is joined within this round: the loop variables are this round's (B023).
        def forget_soon() -> None:
            time.sleep(delay)  # noqa: B023
            try:
                answers.append(_forget(url, root))  # noqa: B023
            except Exception as exc:  # the test's thread judges it
                answers.append(exc)  # noqa: B023

        racer = threading.Thread(target=forget_soon, name="forget")
        racer.start()
        try:
            # Each prompt twice: disk hits whose loads and persists run while acme is forgotten.
            names = race + race
            outs = send_many(llm, names, tenant="acme", session_token=token, persist=True,
                             source_ids=["doc:handbook"])
        finally:
            racer.join(60)
        for name, out in zip(names, outs, strict=True):
            assert_baseline(out, name, base)
        (answer,) = answers
        assert isinstance(answer, dict) and answer["action"] == "forget", answer
        assert_alive(llm, base)

    # Settled (every copy and write of the race has ended), a last forget leaves nothing.
    for _ in range(5):
        assert_alive(llm, base)
    assert _forget(url, root)["action"] == "forget"
    assert_alive(llm, base)
    stats = _ram_stats(url, root)
    assert stats["persists_in_flight"] == 0
    assert "acme" not in stats["tenant_bytes"], stats["tenant_bytes"]
    assert stats["pinned_pages"] == 0, "pages stay pinned after their writes ended"
    assert _catalogued_checkpoints(disk, "acme") == 0
    for _, race in ROUNDS:
        for name in race:
            out = send(llm, name, tenant="acme")
            assert_baseline(out, name, base)
            assert out.num_cached_tokens == 0, (name, out.kv_transfer_params["kvci"])
    assert_alive(llm, base)
