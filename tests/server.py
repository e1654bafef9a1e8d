"""Starting vLLM's real OpenAI-compatible server with the kvci connector, for tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from engine import BLOCK_SIZE, kv_transfer_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> None:
    """Until vLLM's /health answers 200; the server's log tail in the error if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM did not become healthy:\n{log.read_text()[-4000:]}")


class Server:
    def __init__(self, model: Path, extra: dict[str, Any] | None, log: Path, *args: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--block-size", str(BLOCK_SIZE), "--gpu-memory-utilization", "0.2",
               "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching",
               "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", *args]
        if extra is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(extra))]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        self._log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)

    def wait(self, timeout: float = 600) -> Server:
        wait_healthy(self.proc, self.url, Path(self._log.name), timeout)
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        self._log.close()
