"""The lookup window: a control action runs at once outside a step's lookups, and inside them
waits for the step's loads to be planned (or, if the step never ends, for its timeout)."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.lookup_window import LookupWindow
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.disk.tier import KVCheckpointStore

BS = 32
SLOT = 1 << 16
NS = hashlib.sha256(b"lookup-window").digest()
PROMPT = list(range(1, 3 * BS + 2))  # three full blocks and one token


def test_outside_a_step_an_action_runs_at_once_on_the_callers_thread() -> None:
    window = LookupWindow(threading.RLock())
    assert window.run(threading.current_thread) is threading.current_thread()


def test_inside_a_step_an_action_waits_for_the_close_and_runs_once() -> None:
    window = LookupWindow(threading.RLock())
    ran: list[str] = []
    assert window.open() and not window.open()  # the step's first lookup, then a second
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(window.run, lambda: ran.append(threading.current_thread().name) or 7)
        with pytest.raises(TimeoutError):
            asked.result(timeout=0.2)
        assert ran == []  # not between two lookups
        window.close()
        assert asked.result(timeout=5) == 7
    assert ran == [threading.current_thread().name]  # on the thread that closed the window
    window.close()
    assert len(ran) == 1
    assert window.open()  # the next step's first lookup


def test_an_actions_failure_reaches_its_caller() -> None:
    window = LookupWindow(threading.RLock())
    window.open()

    def fails() -> None:
        raise RuntimeError("catalog down")

    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(window.run, fails)
        assert _asked(window)
        window.close()
        with pytest.raises(RuntimeError, match="catalog down"):
            asked.result(timeout=5)


def test_a_step_that_never_ends_does_not_block_the_action_past_its_timeout(caplog) -> None:
    window = LookupWindow(threading.RLock(), timeout_s=0.1)
    ran: list[int] = []
    window.open()
    assert window.run(lambda: ran.append(1) or "applied") == "applied"
    assert "no engine step ended" in caplog.text
    window.close()
    assert ran == [1]  # not applied a second time by a late close


def _asked(window: LookupWindow) -> bool:
    """Waits until the action is queued (the caller's thread got there)."""
    for _ in range(500):
        if window._asked:
            return True
        threading.Event().wait(0.01)
    return False


def test_a_forget_asked_during_a_step_erases_the_disk_on_the_askers_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's thread closes the window and runs only the forget's RAM part; the disk
    tier's part (a catalog transaction, the key material's tombstone) runs on the control
    surface's thread afterwards. Here the catalog is slow: another connection holds its lock."""
    disk = KVCheckpointStore(tmp_path / "disk", NS, 1 << 24)
    s = KVCIScheduler(config=KVCIConfig(ram_bytes=64 * SLOT, ram_policy="lru"), block_size=BS,
                      slot_bytes=SLOT, namespace=NS, secret=b"s" * 32, tp_size=1,
                      tenants=TenantResolver(None), disk=disk)
    monkeypatch.setattr(s.requests.tenants, "authorize_forget", lambda *a: None)
    writer = _request("writer")
    s.get_num_new_matched_tokens(writer, 0)
    writer.num_computed_tokens = len(PROMPT)
    writer.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(writer, [[10, 11, 12, 13]])[0]  # its KV is being stored in RAM
    s.build_connector_meta(_Step())
    s.update_connector_output(_Output({"writer"}))
    s.get_num_new_matched_tokens(_request("reader"), 0)  # a step's lookup opens the window
    other = CheckpointCatalog(tmp_path / "disk" / "catalog.sqlite3")
    with ThreadPoolExecutor(1) as pool:
        with other.locked():
            forgot = pool.submit(s.control.forget_tenant, "acme", None, ())
            assert _asked(s._window)
            started = time.monotonic()
            s.build_connector_meta(_Step())  # closes the window: the RAM part runs here
            assert time.monotonic() - started < 0.5
            assert s.manager.index.stats().tenant_bytes.get("acme", 0) == 0  # RAM: erased
            time.sleep(0.1)
            assert not forgot.done()  # the disk part waits for the catalog, on the asker's thread
        outcome = forgot.result(timeout=10)
    other.close()
    assert outcome.ram_checkpoints == 1
    disk.close()


def _request(req_id: str) -> Request:
    params = {"kv_transfer_params": {"kvci": {"tenant": "acme", "checkpoint": "now"}}}
    return Request(req_id, PROMPT, SamplingParams(max_tokens=1, extra_args=params), None)


class _Step:
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens = 0


class _Output:
    def __init__(self, finished_sending: set[str]) -> None:
        self.finished_sending = finished_sending
        self.kv_connector_worker_meta = None
