"""Real LMCache on CPU for the tests (imported by name: tests/ is not a package).

Everything is LMCache's own code — its config, engine, token database, storage manager, CPU and
disk backends, lookup client and server — except the copy between vLLM's paged KV cache and
LMCache's buffers, which LMCache implements for GPUs only ("No supported cpu connector found").
Its place is taken by LMCache's own `MockGPUConnector` (what LMCache's standalone mode uses), so
the chunks stored here carry no real KV: these tests check which chunks go where, not their bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey, EngineType
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import CreateGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

from kvci_plugin.lmcache.gated_backend import GatedStorageBackend

CHUNK = 32  # LMCache chunk size = vLLM block size on CPU, so every full block is one chunk
HEAD_SIZE = 32
GATED_MODULE = "kvci_plugin.lmcache.gated_backend"


def lmcache_settings(disk: Path | None = None, remote: str | None = None) -> dict[str, Any]:
    """LMCache settings (names without the `lmcache.` prefix): a small CPU tier plus the gated
    tiers asked for, each loaded as a storage plugin."""
    plugins: list[str] = []
    extra: dict[str, Any] = {}
    if disk is not None:
        plugins.append("kvci_disk")
        extra.update({"storage_plugin.kvci_disk.module_path": GATED_MODULE,
                      "storage_plugin.kvci_disk.class_name": "GatedLocalDiskBackend",
                      "kvci.gated_local_disk": str(disk), "kvci.gated_max_local_disk_size": 0.05})
    if remote is not None:
        plugins.append("kvci_remote")
        extra.update({"storage_plugin.kvci_remote.module_path": GATED_MODULE,
                      "storage_plugin.kvci_remote.class_name": "GatedRemoteBackend",
                      "kvci.gated_remote_url": remote})
    return {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.05,
            "storage_plugins": plugins, "extra_config": extra}


def worker_metadata(
    model_name: str = "kvci-test-model", worker_id: int = 0, **fields: Any
) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.bfloat16,
        kv_shape=(2, 2, CHUNK, 2, HEAD_SIZE),
        use_mla=False,
        role="worker",
        chunk_size=CHUNK,
        **fields,
    )


def start_engine(
    name: str, config: LMCacheEngineConfig, metadata: LMCacheMetadata
) -> LMCacheEngine:
    """LMCache's worker-side engine, storage manager and backends (plugins included)."""
    connector = CreateGPUConnector(config, metadata, EngineType.MOCK)
    engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, connector,
                                                lambda tensor, src: tensor, lambda obj, src: obj)
    engine.post_init()
    return engine


def gated(engine: LMCacheEngine, name: str) -> GatedStorageBackend:
    assert engine.storage_manager is not None
    backend = engine.storage_manager.storage_backends[name]
    assert isinstance(backend, GatedStorageBackend)
    return backend


def store(engine: LMCacheEngine, token_ids: Sequence[int], request_configs: dict[str, Any] | None,
          skip_leading: int = 0, req_id: str = "req") -> None:
    """The store call LMCacheConnectorV1Impl.wait_for_save makes for one request (LMCache's
    store path from there on), minus the GPU buffers it copies from."""
    mask = torch.ones(len(token_ids), dtype=torch.bool)
    mask[:skip_leading] = False
    engine.store(list(token_ids), mask=mask, kvcaches=[], slot_mapping=torch.arange(len(token_ids)),
                 offset=skip_leading, request_configs=request_configs, req_id=req_id)


def chunk_keys(engine: LMCacheEngine, token_ids: Sequence[int],
               request_configs: dict[str, Any] | None) -> list[CacheEngineKey]:
    return [key for _, _, key in engine.token_database.process_tokens(list(token_ids),
                                                                       request_configs=request_configs)]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """LMCache writes disk and remote copies on its own threads."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
