"""The key namespace of an engine: everything that makes two KV pages interchangeable.

Model id, model revision (its config and a fingerprint of its weight files), KV dtype, block
size, KV layout and tensor-parallel shape all enter the namespace, so KV of another revision,
dtype, layout or block size can never be loaded: it is simply a miss.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvci_plugin.tiering.keys import namespace_fingerprint


def model_identity(model: str, revision: str | None) -> tuple[dict[str, Any], str]:
    """(config, weights fingerprint) of a model.

    A local folder: its config.json and a SHA-256 over its weight files' names, sizes and
    safetensors headers (cheap, and it changes with any weight update). A hub id: its pinned
    revision (an unpinned hub model gets "unpinned", so pin revisions in production).
    """
    folder = Path(model)
    if not folder.is_dir():
        return {"hub_revision": revision or "unpinned"}, f"hub:{revision or 'unpinned'}"
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = f.read(min(header_len, 1 << 24))
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0" + header)
    return config, "sha256:" + h.hexdigest()


def engine_namespace(
    *,
    model: str,
    revision: str | None,
    revision_override: str | None,
    kv_dtype: str,
    block_size: int,
    kv_layout: str,
    tp_rank: int,
    tp_size: int,
) -> bytes:
    config, weights = model_identity(model, revision)
    return namespace_fingerprint(
        model_id=model,
        model_config=config,
        weights_fingerprint=revision_override or weights,
        kv_cache_dtype=kv_dtype,
        block_size=block_size,
        kv_layout=kv_layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
