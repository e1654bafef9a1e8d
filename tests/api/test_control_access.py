"""The control surface is safe by default and gives each caller the least authority (#46 finding 5),
on a real uvicorn server on loopback, started as the connector starts it (`start_control_server`
with the connector's config) over a real checkpoint manager.

- A bearer token by default: generated into `state_dir`, owner-only, printed once; no token, 401.
- Every request's `Host` is on an allow-list and its `Origin`, when present, too: a page a browser
  loaded from another site (DNS rebinding) reaches nothing.
- Operator actions (reset, every tenant's stats, explain of any checkpoint) need the operator
  token; the tenant token acts within one tenant, the one its session credential (or, with
  tenancy "declared", its declaration) names.
- checkpoint_now binds the arm to its caller and hands no credential to the request that later
  spends it (finding 12).
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvci_plugin.api.schema import ENDPOINT
from kvci_plugin.api.server import ControlServer, start_control_server
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.governance import FORGET_SCOPE

OPERATOR_FILE = "control-operator.token"
TENANT_FILE = "control-tenant.token"


def serve(world: Any, state: Path, **config: Any) -> ControlServer:
    return start_control_server(world.side, KVCIConfig(control_port=0, state_dir=state, **config))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def served(world: Any, state: Path) -> Iterator[ControlServer]:
    server = serve(world, state)
    yield server
    server.stop()


def bearer(path: Path) -> dict[str, str]:
    return {"Authorization": f"Bearer {path.read_text().strip()}"}


def call(
    server: ControlServer, headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    return httpx.post(server.url + ENDPOINT, json=body, headers=headers or {}, timeout=30)


def error_code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json().get("error", {}).get("code")


# ---- a token by default --------------------------------------------------------------------------

def test_a_token_by_default_owner_only_and_printed_once(
        world: Any, state: Path, capfd: pytest.CaptureFixture[str]) -> None:
    server = serve(world, state)
    try:
        assert error_code(call(server, action="ram_stats")) == (401, "unauthorized")
        operator, tenant = state / OPERATOR_FILE, state / TENANT_FILE
        for path in (operator, tenant):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            assert len(path.read_text().strip()) >= 32
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert operator.read_text() != tenant.read_text()
        printed = capfd.readouterr().err
        for path in (operator, tenant):
            assert printed.count(path.read_text().strip()) == 1 and str(path) in printed
        assert call(server, bearer(operator), action="ram_stats").status_code == 200
        wrong = {"Authorization": "Bearer " + "x" * 43}
        assert error_code(call(server, wrong, action="ram_stats")) == (401, "unauthorized")
    finally:
        server.stop()
    again = serve(world, state)  # a restart keeps the tokens and prints none of them
    try:
        assert call(again, bearer(operator), action="ram_stats").status_code == 200
        printed = capfd.readouterr().err
        assert (
            operator.read_text().strip() not in printed
            and tenant.read_text().strip() not in printed
        )
    finally:
        again.stop()


def test_a_token_file_others_can_read_is_refused(world: Any, state: Path, tmp_path: Path) -> None:
    token = tmp_path / "operator.token"
    token.write_text("s3cret-control-token-0123456789\n")
    token.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        serve(world, state, control_token_file=token)


# ---- Host and Origin -----------------------------------------------------------------------------

def test_a_foreign_host_is_refused(served: ControlServer, world: Any, state: Path) -> None:
    """DNS rebinding: a page from evil.example whose name now resolves to 127.0.0.1."""
    for headers in ({"Host": f"evil.example:{served.port}"},
                    {"Host": f"evil.example:{served.port}", **bearer(state / OPERATOR_FILE)},
                    {"Host": "127.0.0.1.evil.example", **bearer(state / OPERATOR_FILE)}):
        response = call(served, headers, action="reset")
        assert error_code(response) == (403, "host_not_allowed"), headers
        assert "evil.example" not in response.text
    assert world.manager.generation == 0  # nothing was reset
    for host in (f"localhost:{served.port}", f"127.0.0.1:{served.port}", "LOCALHOST"):
        ok = call(served, {"Host": host, **bearer(state / OPERATOR_FILE)}, action="ram_stats")
        assert ok.status_code == 200, host


def test_a_foreign_origin_is_refused(served: ControlServer, world: Any, state: Path) -> None:
    operator = bearer(state / OPERATOR_FILE)
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{served.port}.evil.example"):
        response = call(served, {"Origin": origin, **operator}, action="reset")
        assert error_code(response) == (403, "origin_not_allowed"), origin
    assert world.manager.generation == 0


def test_allowed_hosts_and_origins_are_configured(world: Any, state: Path) -> None:
    server = serve(world, state, control_allowed_hosts=["kvci.internal"],
                   control_allowed_origins=["https://console.internal"])
    try:
        operator = bearer(state / OPERATOR_FILE)
        assert (
            call(
                server,
                {"Host": "kvci.internal", "Origin": "https://console.internal", **operator},
                action="ram_stats",
            ).status_code
            == 200
        )
        assert error_code(
            call(
                server,
                {"Host": "kvci.internal", "Origin": "https://evil.example", **operator},
                action="ram_stats",
            )
        ) == (403, "origin_not_allowed")
    finally:
        server.stop()


# ---- per-action authority ------------------------------------------------------------------------

def test_a_tenant_acts_within_its_own_tenant(
    served: ControlServer, world: Any, state: Path
) -> None:
    acme, globex = (
        world.checkpoint(tenant="acme", pages=2),
        world.checkpoint(tenant="globex", pages=3),
    )
    tenant = bearer(state / TENANT_FILE)

    assert error_code(call(served, tenant, action="reset")) == (403, "operator_required")
    assert world.manager.generation == 0

    stats = call(served, tenant, action="ram_stats", tenant="acme").json()["stats"]
    assert stats["tenant_bytes"] == {"acme": 2 * 256}
    assert call(served, tenant, action="ram_stats").json()["stats"]["tenant_bytes"] == {}

    # Without a tenant, explain is the default tenant's: another tenant's checkpoint is not found.
    assert error_code(call(served, tenant, action="explain", checkpoint_id=globex)) == (
        404, "checkpoint_not_found")
    assert error_code(
        call(served, tenant, action="explain", checkpoint_id=globex, tenant="acme")
    ) == (404, "checkpoint_not_found")
    assert call(served, tenant, action="explain", checkpoint_id=acme,
                tenant="acme").json()["explanation"]["tenant"] == "acme"
    forget = call(served, tenant, action="forget", tenant="globex",
                  session_token=world.session(tenant="acme", scopes=[FORGET_SCOPE]))
    assert error_code(forget) == (403, "credential_refused")

    operator = bearer(state / OPERATOR_FILE)
    assert call(served, operator, action="explain", checkpoint_id=globex).status_code == 200
    assert call(served, operator, action="ram_stats").json()["stats"]["tenant_bytes"] == {
        "acme": 2 * 256, "globex": 3 * 256}
    assert call(served, operator, action="reset").json()["status"] == "done"


def test_under_verified_tenancy_a_tenant_shows_its_credential(
        served: ControlServer, world: Any, state: Path) -> None:
    world.side.tenancy = "verified"
    acme = world.checkpoint(tenant="acme")
    tenant = bearer(state / TENANT_FILE)
    for who in ({}, {"tenant": "acme"}):
        response = call(served, tenant, action="explain", checkpoint_id=acme, **who)
        assert error_code(response) == (403, "credential_refused"), who
    other = call(served, tenant, action="explain", checkpoint_id=acme,
                 session_token=world.session(tenant="globex"))
    assert error_code(other) == (404, "checkpoint_not_found")
    own = call(served, tenant, action="explain", checkpoint_id=acme, session_token=world.session())
    assert own.json()["explanation"]["checkpoint_id"] == acme
    assert error_code(call(served, tenant, action="ram_stats")) == (403, "credential_refused")
    stats = call(served, tenant, action="ram_stats", session_token=world.session(tenant="globex"))
    assert stats.json()["stats"]["tenant_bytes"] == {}


# ---- an armed checkpoint is bound to its caller, and carries no credential (finding 12) ------

def test_checkpoint_now_hands_no_credential_to_a_later_request(
        served: ControlServer, world: Any, state: Path) -> None:
    """With tenancy "declared" any client may send tenant acme and session s-1: the arm is
    bound to the arming caller's credential (the target keeps its digest, never the credential),
    and a disk copy is gated on the finishing request's own credential (or a later promote's)."""
    token = world.session()
    body = call(served, bearer(state / TENANT_FILE), action="checkpoint_now", session_id="s-1",
                session_token=token, persist=True).json()
    assert body["armed"] is True and body["tenant"] == "acme"
    assert world.side.armed[("acme", "s-1")] == {
        "trigger": "user", "persist": True, "session_token": token}
    assert "own credential" in body["detail"]
