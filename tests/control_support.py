"""Helpers for the control-surface tests (imported by name: tests/ is not a package): the app as
served, in process, with two known bearer tokens; a real server started as the connector starts
it; the tokens it generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.testclient import TestClient
from starlette.types import ASGIApp

from kvci_plugin.api.access import HostPolicy
from kvci_plugin.api.app import build_app
from kvci_plugin.api.control import ControlPlane
from kvci_plugin.api.guards import BearerTokens
from kvci_plugin.api.server import ControlServer, ControlSettings, serve_control_plane
from kvci_plugin.api.tokens import operator_token_path, tenant_token_path

# The in-process app's two bearer tokens, and the Host starlette's TestClient sends.
OPERATOR_TOKEN = "operator-token-0123456789abcdef"
TENANT_TOKEN = "tenant-token-0123456789abcdef"
TEST_HOST = "testserver"


def control_app(plane: ControlPlane, **options: Any) -> ASGIApp:
    """The control surface's app as served, with this module's tokens, answering TestClient's
    Host."""
    return build_app(plane, tokens=BearerTokens(OPERATOR_TOKEN.encode(), TENANT_TOKEN.encode()),
                     hosts=HostPolicy.for_bind("127.0.0.1", (TEST_HOST,)), **options)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def control_client(plane: ControlPlane, token: str = OPERATOR_TOKEN) -> TestClient:
    """An in-process client of the control surface bearing `token` (the operator's by default)."""
    return TestClient(control_app(plane), headers=bearer(token))


def serve(plane: ControlPlane, state_dir: Path, **settings: Any) -> ControlServer:
    """A real control server on a free loopback port, its tokens generated in `state_dir`."""
    return serve_control_plane(plane, ControlSettings(port=0, state_dir=state_dir, **settings))


def operator_token(state_dir: Path) -> Path:
    return operator_token_path(state_dir)


def tenant_token(state_dir: Path) -> Path:
    return tenant_token_path(state_dir)
