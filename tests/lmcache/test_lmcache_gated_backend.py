"""kvci's gated durable tiers inside LMCache's real engine on CPU.

LMCache builds the gated backends itself from its `storage_plugins` setting, and its own store
path (token database -> CPU allocation -> StorageManager.batched_put to every backend) delivers
the chunks; the only stand-in is LMCache's MockGPUConnector for the GPU copy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache_support import (
    CHUNK,
    chunk_keys,
    gated,
    lmcache_settings,
    start_engine,
    store,
    wait_until,
    worker_metadata,
)

from kvci_plugin.lmcache.gated_backend import GatedLocalDiskBackend, GatedRemoteBackend
from kvci_plugin.lmcache.request_configs import DURABLE_UNTIL, durable_marker

rng = random.Random(11)


def _prompt(chunks: int = 3) -> list[int]:
    return [rng.randrange(2, 30000) for _ in range(chunks * CHUNK)]


def _permit(until: float | None) -> dict[str, str]:
    """The request configs of a request the gate permitted until `until` (None = no limit)."""
    return {DURABLE_UNTIL: durable_marker(until)}


def _later(seconds: float = 3600.0) -> float:
    return time.time() + seconds


@pytest.fixture(scope="module")
def disk_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LMCacheEngine, Path]]:
    folder = tmp_path_factory.mktemp("gated_disk")
    engine = start_engine(
        "kvci-gated-disk",
        LMCacheEngineConfig.from_defaults(**lmcache_settings(disk=folder)),
        worker_metadata(),
    )
    yield engine, folder
    LMCacheEngineBuilder.destroy("kvci-gated-disk")


def _on_disk(engine: LMCacheEngine, keys: list) -> bool:
    return all(gated(engine, "kvci_disk").contains(key) for key in keys)


def _nowhere(engine: LMCacheEngine, keys: list) -> bool:
    backend = gated(engine, "kvci_disk")
    return not any(backend.contains(key) or backend.exists_in_put_tasks(key) for key in keys)


def test_lmcache_builds_the_gated_disk_tier_around_its_own_disk_backend(disk_engine):
    engine, folder = disk_engine
    assert engine.storage_manager is not None
    backends = engine.storage_manager.storage_backends
    assert list(backends) == ["LocalCPUBackend", "kvci_disk"]
    disk = backends["kvci_disk"]
    assert isinstance(disk, GatedLocalDiskBackend)
    assert isinstance(disk.inner, LocalDiskBackend)
    assert Path(disk.inner.path) == folder


def test_only_permitted_chunks_reach_disk_while_cpu_takes_every_chunk(disk_engine):
    engine, _ = disk_engine
    permitted, plain = _prompt(), _prompt()
    store(engine, permitted, _permit(_later()))
    store(engine, plain, {"lmcache.skip_save": False})
    permitted_keys = chunk_keys(engine, permitted, _permit(_later()))
    plain_keys = chunk_keys(engine, plain, None)
    assert wait_until(lambda: _on_disk(engine, permitted_keys))
    assert _nowhere(engine, plain_keys)
    cpu = engine.storage_manager.storage_backends["LocalCPUBackend"]
    assert all(cpu.contains(key) for key in permitted_keys + plain_keys)


@pytest.mark.parametrize("marker", ["expired", "abc", "nan", "", None, 1e12])
def test_a_dead_or_unreadable_permit_is_refused(disk_engine, marker):
    engine, _ = disk_engine
    value = repr(time.time() - 1.0) if marker == "expired" else marker
    tokens = _prompt(2)
    configs = {DURABLE_UNTIL: value}
    before = gated(engine, "kvci_disk").refused
    store(engine, tokens, configs)
    assert gated(engine, "kvci_disk").refused == before + 2
    assert _nowhere(engine, chunk_keys(engine, tokens, configs))


def test_a_copy_is_deleted_once_its_retention_expires(disk_engine):
    engine, folder = disk_engine
    tokens = _prompt(2)
    until = time.time() + 3.0
    store(engine, tokens, _permit(until))
    keys = chunk_keys(engine, tokens, _permit(until))
    assert wait_until(lambda: _on_disk(engine, keys))
    files = {Path(gated(engine, "kvci_disk").inner._key_to_path(key)) for key in keys}
    assert all(path.exists() for path in files)
    assert wait_until(lambda: time.time() > until)
    assert not any(gated(engine, "kvci_disk").contains(key) for key in keys)
    assert not any(path.exists() for path in files)


def test_a_later_permit_for_the_same_bytes_extends_the_copy(disk_engine):
    engine, _ = disk_engine
    tokens = _prompt(1)
    short = time.time() + 2.0
    store(engine, tokens, _permit(short))
    keys = chunk_keys(engine, tokens, None)
    assert wait_until(lambda: _on_disk(engine, keys))
    store(engine, tokens, _permit(_later()))
    assert wait_until(lambda: time.time() > short)
    assert _on_disk(engine, keys)


def test_shutdown_deletes_retention_limited_copies_and_keeps_unlimited_ones(tmp_path):
    engine = start_engine(
        "kvci-gated-close",
        LMCacheEngineConfig.from_defaults(**lmcache_settings(disk=tmp_path)),
        worker_metadata(),
    )
    limited, unlimited = _prompt(2), _prompt(2)
    store(engine, limited, _permit(_later()))
    store(engine, unlimited, _permit(None))
    backend = gated(engine, "kvci_disk")
    limited_files = {
        Path(backend.inner._key_to_path(key)) for key in chunk_keys(engine, limited, None)
    }
    unlimited_files = {
        Path(backend.inner._key_to_path(key)) for key in chunk_keys(engine, unlimited, None)
    }
    assert wait_until(lambda: all(path.exists() for path in limited_files | unlimited_files))
    LMCacheEngineBuilder.destroy("kvci-gated-close")
    assert not any(path.exists() for path in limited_files)
    assert all(path.exists() for path in unlimited_files)


def test_files_an_earlier_process_left_are_deleted_at_start_for_this_worker_only(tmp_path):
    mine = tmp_path / "kvci-test-model@1@0@1a2b@bfloat16@kvci_tenant%00ff.pt"
    other_worker = tmp_path / "kvci-test-model@1@1@1a2b@bfloat16.pt"
    other_model = tmp_path / "another-model@1@0@1a2b@bfloat16.pt"
    unrelated = tmp_path / "notes.txt"
    for path in (mine, other_worker, other_model, unrelated):
        path.write_bytes(b"x")
    start_engine(
        "kvci-gated-leftovers",
        LMCacheEngineConfig.from_defaults(**lmcache_settings(disk=tmp_path)),
        worker_metadata(),
    )
    LMCacheEngineBuilder.destroy("kvci-gated-leftovers")
    assert not mine.exists()
    assert other_worker.exists() and other_model.exists() and unrelated.exists()


def test_the_remote_tier_takes_only_permits_without_a_retention_limit(tmp_path):
    config = LMCacheEngineConfig.from_defaults(**lmcache_settings(remote=f"fs://localhost:0{tmp_path}"))
    engine = start_engine("kvci-gated-remote", config, worker_metadata())
    try:
        backend = gated(engine, "kvci_remote")
        assert isinstance(backend, GatedRemoteBackend) and isinstance(backend.inner, RemoteBackend)
        limited, unlimited = _prompt(2), _prompt(2)
        store(engine, limited, _permit(_later()))
        store(engine, unlimited, _permit(None))
        unlimited_keys = chunk_keys(engine, unlimited, None)
        assert wait_until(lambda: all(backend.contains(key) for key in unlimited_keys))
        assert not any(backend.contains(key) or backend.exists_in_put_tasks(key)
                       for key in chunk_keys(engine, limited, None))
        assert (backend.admitted, backend.refused) == (2, 2)
        assert len(list(tmp_path.iterdir())) == 2
    finally:
        LMCacheEngineBuilder.destroy("kvci-gated-remote")
