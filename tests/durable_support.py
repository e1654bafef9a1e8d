"""Shared set-up of the durable-path tests: credentials, labels, prompts, catalog probes, and
engine nodes in their own processes (the test side starts them, the node script runs them)."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine import BLOCK_SIZE, generate_one, kvci_params, make_llm

READY = "READY "

SOURCES = {
    "doc:handbook": {"classification": "INTERNAL", "residency_regions": ["eu"],
                     "retention_days": 30, "mandatory_markings": []},
}


def prompts() -> dict[str, list[int]]:
    rng = random.Random(11)

    def toks(n: int) -> list[int]:
        return [rng.randrange(2, 1000) for _ in range(n)]

    return {"persisted": toks(5 * BLOCK_SIZE + 7), "refused": toks(4 * BLOCK_SIZE + 3),
            "flipped": toks(4 * BLOCK_SIZE + 9)}


def setup_dirs(root: Path) -> dict[str, Any]:
    """Key file, label catalog JSON and the connector's extra config for a durable engine."""
    from kvci_plugin.governance import write_hmac_key_file

    root.mkdir(parents=True, exist_ok=True)
    key = write_hmac_key_file(root / "hs256.key")
    labels = root / "labels.json"
    labels.write_text(json.dumps(SOURCES))
    extra = {
        "ram_bytes": "32MiB", "state_dir": str(root / "state"), "system_trigger": False,
        "disk_root": str(root / "disk"), "disk_bytes": "64MiB", "disk_region": "eu",
        "credentials": {"algorithm": "HS256", "key_file": str(key)},
        "label_catalog": str(root / "labels.sqlite3"), "label_catalog_json": str(labels),
    }
    return extra


def session_token(root: Path, **overrides: Any) -> str:
    from kvci_plugin.governance import CredentialIssuer

    issuer = CredentialIssuer.from_key_file("HS256", root / "hs256.key")
    claims = dict(actor="alice", tenant="acme", scopes=["kv:persist"], clearance="CONFIDENTIAL",
                  markings=[], regions=["eu"], policy_version=1)
    claims.update(overrides)
    return issuer.issue_session(**claims)


def catalog_rows(disk_root: Path) -> dict[str, int]:
    """checkpoint id -> page count, read-only (the engine may hold the store open)."""
    path = disk_root / "catalog.sqlite3"
    if not path.exists():
        return {}
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute(
            "SELECT checkpoint_id, COUNT(*) FROM checkpoint_pages GROUP BY checkpoint_id"
        ).fetchall()
        return {cid: n for cid, n in rows}
    finally:
        conn.close()


def catalog_page_keys(disk_root: Path) -> set[str]:
    """The key of every page row, referenced by a checkpoint or not, read-only."""
    conn = sqlite3.connect(f"file:{disk_root / 'catalog.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        return {r[0] for r in conn.execute("SELECT key FROM pages")}
    finally:
        conn.close()


def blob_paths(disk_root: Path) -> list[Path]:
    return sorted((disk_root / "blobs").rglob("*.safetensors"))


def checkpoint_blob_keys(disk_root: Path, checkpoint_id: str) -> list[str]:
    conn = sqlite3.connect(f"file:{disk_root / 'catalog.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute(
            "SELECT key FROM checkpoint_pages WHERE checkpoint_id=? ORDER BY position",
            (checkpoint_id,),
        ).fetchall()
        return [r[0] for r in rows]
    finally:
        conn.close()


def shared_catalog_ids(catalog_url: str) -> set[str]:
    """Checkpoint ids recorded in a shared PostgreSQL catalog."""
    import psycopg

    with psycopg.connect(catalog_url) as conn:
        return {r[0] for r in conn.execute("SELECT checkpoint_id FROM checkpoints")}


def start_node(script: Path, root: Path, model: Path,
               extra: dict[str, Any]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a node script on `extra` in its own process group (so a test can kill all of it)
    and wait for its READY line; returns the process, its stdin a pipe, and the READY payload."""
    (root / "extra.json").write_text(json.dumps(extra))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(model)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(READY):
            return proc, json.loads(line[len(READY):])
    proc.wait(timeout=30)
    pytest.fail(f"{script.name} exited ({proc.returncode}) before READY")


@dataclass
class NodeEngine:
    """Inside a node script: the engine that `start_node` asked for."""

    root: Path
    extra: dict[str, Any]
    llm: Any

    @classmethod
    def from_argv(cls) -> NodeEngine:
        root, model = Path(sys.argv[1]), Path(sys.argv[2])
        extra = json.loads((root / "extra.json").read_text())
        return cls(root, extra, make_llm(model, extra))

    def run(self, tokens: list[int], **kvci: object) -> dict[str, Any]:
        """Generate for `tokens` with `kvci` as the request's kvci params; the reply's kvci."""
        return generate_one(self.llm, tokens, kvci_params(**kvci)).kv_transfer_params["kvci"]

    def step_until(self, done: Callable[[], bool], failure: str) -> None:
        """Step the engine until `done()`, so queued persist jobs reach the worker; exit with
        `failure` after 60 s."""
        deadline = time.monotonic() + 60
        while not done():
            if time.monotonic() > deadline:
                raise SystemExit(failure)
            self.run([5, 6, 7])

    @staticmethod
    def ready(replies: dict[str, dict[str, Any]]) -> None:
        """Tell `start_node` each reply's checkpoint id and persist outcome."""
        print(READY + json.dumps({k: {"checkpoint_id": v["checkpoint_id"], "persist": v["persist"]}
                                  for k, v in replies.items()}), flush=True)
