"""Serving the control surface from inside the engine: uvicorn on a daemon thread.

`start_control_server(scheduler, config)` is what the connector's scheduler role calls when
`control_port` is set. The socket is bound before the thread starts, so a taken port or a bad
address fails the engine's start with a clear error rather than later in a log. Safe by default:

- every call needs a bearer token, the operator's or the tenants' (`tokens`): unless configured,
  both are generated into `state_dir` at the first start (0600) and printed once on standard error;
- the Host and Origin allow-lists (`access.HostPolicy`) answer nothing else;
- loopback, or any other address with TLS (`control_tls_cert_file`, `control_tls_key_file`).
"""

from __future__ import annotations

import logging
import socket
import ssl
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from starlette.types import ASGIApp

from kvci_plugin.api.access import HostPolicy, check_bind
from kvci_plugin.api.app import DEFAULT_MAX_BODY_BYTES, build_app
from kvci_plugin.api.control import ControlPlane
from kvci_plugin.api.guards import BearerTokens
from kvci_plugin.api.tokens import (
    ensure_token_file,
    load_bearer_token,
    operator_token_path,
    tenant_token_path,
)

if TYPE_CHECKING:
    from kvci_plugin.connector.config import KVCIConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlSettings:
    """Where and how the control surface is served (the connector's `control_*` settings)."""

    port: int
    state_dir: Path  # where the tokens not configured are generated
    host: str = "127.0.0.1"
    operator_token_file: Path | None = None
    tenant_token_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def from_config(cls, config: KVCIConfig) -> ControlSettings:
        if config.control_port is None:
            raise ValueError("control_port is not set")
        return cls(port=config.control_port, state_dir=config.state_dir, host=config.control_host,
                   operator_token_file=config.control_token_file,
                   tenant_token_file=config.control_tenant_token_file,
                   tls_cert_file=config.control_tls_cert_file,
                   tls_key_file=config.control_tls_key_file,
                   allowed_hosts=tuple(config.control_allowed_hosts),
                   allowed_origins=tuple(config.control_allowed_origins))

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def tokens(self) -> BearerTokens:
        """The two bearer tokens: the configured files, else the state folder's (generated at
        the first start, and printed then, once)."""
        return BearerTokens(
            operator=_token(self.operator_token_file, operator_token_path(self.state_dir),
                            "operator token (every action, every tenant)"),
            tenant=_token(self.tenant_token_file, tenant_token_path(self.state_dir),
                          "tenant token (a tenant's own actions)"))


def _token(configured: Path | None, default: Path, what: str) -> bytes:
    if configured is not None:
        return load_bearer_token(configured)
    created = ensure_token_file(default)
    if created is not None:
        # Printed, not logged: a log may be shipped where the token must not go.
        print(f"kvci: control surface {what}, written to {default} (owner-only; shown this once):\n"
              f"  {created}", file=sys.stderr, flush=True)
    return load_bearer_token(default)


class ControlServer:
    """An ASGI app served by uvicorn from a daemon thread, on a socket bound at construction."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        *,
        lifespan: Literal["on", "off"] = "off",
        tls_cert_file: Path | None = None,
        tls_key_file: Path | None = None,
    ) -> None:
        check_bind(host, tls_cert_file is not None)
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ValueError("a TLS certificate and its key go together")
        # log_config=None: uvicorn must not reconfigure logging inside vLLM's process.
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                                lifespan=lifespan, loop="asyncio", server_header=False,
                                limit_concurrency=64, timeout_graceful_shutdown=2,
                                ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file)
        if tls_key_file is not None:
            _check_tls(config, tls_cert_file, tls_key_file)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise OSError(
                exc.errno, f"kvci control surface cannot bind {host}:{port}: {exc.strerror}"
            ) from None
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.tls = tls_cert_file is not None
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="kvci-control", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ControlServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvci control surface did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()


def _check_tls(config: uvicorn.Config, cert: Path | None, key: Path) -> None:
    """Load the certificate and key now, so a bad pair fails the engine's start, not a thread."""
    try:
        mode = key.stat().st_mode
    except OSError as exc:
        raise ValueError(f"control_tls_key_file {key}: {exc.strerror}") from None
    if mode & stat.S_IROTH:
        raise ValueError(f"control_tls_key_file {key} is readable by others (chmod o-r it, and "
                         "replace the key if others may have read it)")
    try:
        config.load()
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"control_tls_cert_file {cert} / control_tls_key_file {key} do not load "
                         f"as a certificate and its key: {exc}") from None


def serve_control_plane(plane: ControlPlane, settings: ControlSettings) -> ControlServer:
    """Validate the bind, load (or generate) the tokens and start serving `plane`."""
    check_bind(settings.host, settings.tls)
    hosts = HostPolicy.for_bind(settings.host, settings.allowed_hosts, settings.allowed_origins)
    app = build_app(
        plane, tokens=settings.tokens(), hosts=hosts, max_body_bytes=settings.max_body_bytes
    )
    return ControlServer(app, settings.host, settings.port, tls_cert_file=settings.tls_cert_file,
                         tls_key_file=settings.tls_key_file).start()


def start_control_server(scheduler: Any, config: KVCIConfig) -> ControlServer:
    """The connector's entry: serve the scheduler's manager on `control_host:control_port`."""
    settings = ControlSettings.from_config(config)
    server = serve_control_plane(ControlPlane(scheduler), settings)
    logger.info("kvci: control surface on %s (bearer tokens: operator %s, tenant %s)", server.url,
                settings.operator_token_file or operator_token_path(settings.state_dir),
                settings.tenant_token_file or tenant_token_path(settings.state_dir))
    return server
