"""Serving the control surface from inside the engine: uvicorn on a daemon thread.

`start_control_server(scheduler, config)` is what the connector's scheduler role calls when
`control_port` is set. The socket is bound before the thread starts, so a taken port or a bad
address fails the engine's start with a clear error rather than later in a log. Loopback is
the default; any other address needs `control_token_file`, and then every call must carry
`Authorization: Bearer <token>`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from starlette.types import ASGIApp

from kvci_plugin.api.access import check_bind, load_bearer_token
from kvci_plugin.api.app import DEFAULT_MAX_BODY_BYTES, build_app
from kvci_plugin.api.control import ControlPlane

if TYPE_CHECKING:
    from kvci_plugin.connector.config import KVCIConfig

logger = logging.getLogger(__name__)


class ControlServer:
    """An ASGI app served by uvicorn from a daemon thread, on a socket bound at construction."""

    def __init__(self, app: ASGIApp, host: str, port: int, *,
                 lifespan: Literal["on", "off"] = "off") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"kvci control surface cannot bind {host}:{port}: {exc.strerror}") from None
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        # log_config=None: uvicorn must not reconfigure logging inside vLLM's process.
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                                lifespan=lifespan, loop="asyncio", server_header=False,
                                limit_concurrency=64, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="kvci-control", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

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


def serve_control_plane(plane: ControlPlane, *, host: str, port: int, token_file: Path | None,
                        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ControlServer:
    """Validate the bind, load the bearer token and start serving `plane`."""
    check_bind(host, token_file)
    token = load_bearer_token(token_file) if token_file is not None else None
    app = build_app(plane, bearer_token=token, max_body_bytes=max_body_bytes)
    return ControlServer(app, host, port).start()


def start_control_server(scheduler: Any, config: KVCIConfig) -> ControlServer:
    """The connector's entry: serve the scheduler's manager on `control_host:control_port`."""
    if config.control_port is None:
        raise ValueError("control_port is not set")
    server = serve_control_plane(
        ControlPlane(scheduler), host=config.control_host,
        port=config.control_port, token_file=config.control_token_file)
    logger.info("kvci: control surface on %s (bearer %s)", server.url,
                "required" if config.control_token_file is not None else "off: loopback only")
    return server
