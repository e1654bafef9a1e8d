"""Shared set-up of the durable-path tests: credentials, labels, prompts, catalog probes."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path
from typing import Any

from engine import BLOCK_SIZE

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
            "SELECT checkpoint_id, COUNT(*) FROM checkpoint_pages GROUP BY checkpoint_id").fetchall()
        return {cid: n for cid, n in rows}
    finally:
        conn.close()


def blob_paths(disk_root: Path) -> list[Path]:
    return sorted((disk_root / "blobs").rglob("*.safetensors"))


def checkpoint_blob_keys(disk_root: Path, checkpoint_id: str) -> list[str]:
    conn = sqlite3.connect(f"file:{disk_root / 'catalog.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute("SELECT key FROM checkpoint_pages WHERE checkpoint_id=? ORDER BY position",
                            (checkpoint_id,)).fetchall()
        return [r[0] for r in rows]
    finally:
        conn.close()
