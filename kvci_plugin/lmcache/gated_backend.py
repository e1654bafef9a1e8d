"""LMCache storage backends that take a chunk only with the eligibility gate's permit.

LMCache 0.5.x writes every chunk it saves to every configured backend
(`StorageManager.batched_put`). A durable tier is therefore reached through the gate only if
the backend itself refuses: `GatedStorageBackend` wraps one of LMCache's own backends and
admits a put only for keys whose request carried a live permit (`lmcache.kvci.durable_until`,
written by the kvci facade at admission and copied by LMCache into every `CacheEngineKey`).
No permit, an expired one, or an unreadable one: refused. Reads, pins and removals delegate.

LMCache loads the two concrete backends as storage plugins (`storage_plugins` +
`extra_config.storage_plugin.<name>.module_path/class_name`, with this module and the class
name); their own settings are read from `extra_config`:

- `GatedLocalDiskBackend`: LMCache's LocalDiskBackend at `kvci.gated_local_disk` (a folder),
  bounded by `kvci.gated_max_local_disk_size` (GB). It keeps permits with a retention limit:
  it deletes a copy once the permit's retention expires (at the next put, lookup or read),
  every such copy at shutdown, and at start the files an earlier process left behind
  (LocalDiskBackend never re-reads its folder, so they could never be expired otherwise).
- `GatedRemoteBackend`: LMCache's RemoteBackend at `kvci.gated_remote_url` (any LMCache remote
  URL, e.g. `fs://`, `lm://`, `redis://`). A remote copy outlives this process and may be read
  by others, and kvci cannot delete it on time, so only a permit without a retention limit
  (every source PUBLIC-derived) is written there.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import (
    AllocatorBackendInterface,
    StorageBackendInterface,
)
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvci_plugin.lmcache.request_configs import durable_until

logger = logging.getLogger(__name__)

LOCAL_DISK_KEY = "kvci.gated_local_disk"
LOCAL_DISK_SIZE_KEY = "kvci.gated_max_local_disk_size"
REMOTE_URL_KEY = "kvci.gated_remote_url"


class GatedStorageBackend(StorageBackendInterface):
    """Delegates to `inner`; a put is admitted only for keys that carry a live permit."""

    def __init__(self, inner: StorageBackendInterface, *, keeps_finite_retention: bool) -> None:
        super().__init__(dst_device=inner.dst_device)
        self.inner = inner
        self.keeps_finite_retention = keeps_finite_retention
        self._lock = threading.Lock()
        # Copies with a retention limit: key -> expiry, and a heap to find the expired ones.
        self._expiry: dict[CacheEngineKey, float] = {}
        self._heap: list[tuple[float, int, CacheEngineKey]] = []
        self._seq = itertools.count()
        self.admitted = 0
        self.refused = 0

    def __str__(self) -> str:
        return f"Gated{self.inner}"

    # ---- the gate -----------------------------------------------------------------------------

    def permit(self, key: CacheEngineKey) -> float | None:
        """The expiry of the live permit `key` carries (math.inf = no limit) if this tier
        honours it; None = refused."""
        until = durable_until(key.request_configs)
        if until is None or until <= time.time():
            return None
        if math.isfinite(until) and not self.keeps_finite_retention:
            return None
        return until

    def _admit(self, keys: Sequence[CacheEngineKey],
               objs: list[MemoryObj]) -> tuple[list[CacheEngineKey], list[MemoryObj]]:
        self._expire_due()
        kept_keys, kept_objs = [], []
        with self._lock:
            for key, obj in zip(keys, objs, strict=True):
                until = self.permit(key)
                if until is None:
                    self.refused += 1
                    continue
                if math.isfinite(until) and until > self._expiry.get(key, -math.inf):
                    # The same bytes under a later permit are kept until the later expiry.
                    self._expiry[key] = until
                    heapq.heappush(self._heap, (until, next(self._seq), key))
                self.admitted += 1
                kept_keys.append(key)
                kept_objs.append(obj)
        if len(kept_keys) < len(keys):
            logger.debug("%s refused %d of %d chunks without a live kvci permit",
                         self, len(keys) - len(kept_keys), len(keys))
        return kept_keys, kept_objs

    def _expire_due(self) -> None:
        now = time.time()
        due = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                until, _, key = heapq.heappop(self._heap)
                if self._expiry.get(key) == until:
                    del self._expiry[key]
                    due.append(key)
        # Retention is counted in days (the gate refuses 0), far beyond a write's latency, so a
        # copy still being written when it expires is not a case to handle.
        for key in due:
            self.inner.remove(key)
        if due:
            logger.info("%s deleted %d chunk(s) whose retention expired", self, len(due))

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        kept_keys, kept_objs = self._admit(keys, objs)
        if not kept_keys:
            return None
        return self.inner.batched_submit_put_task(
            kept_keys, kept_objs, transfer_spec, on_complete_callback
        )

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        kept_keys, kept_objs = self._admit(keys, objs)
        if kept_keys:
            await self.inner.async_batched_submit_put_task(kept_keys, kept_objs, transfer_spec,
                                                           on_complete_callback)

    # ---- everything else delegates, after expired copies are gone -------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        self._expire_due()
        return self.inner.contains(key, pin)

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        self._expire_due()
        return self.inner.batched_contains(keys, pin)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        self._expire_due()
        return await self.inner.batched_async_contains(lookup_id, keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.inner.exists_in_put_tasks(key)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        self._expire_due()
        return self.inner.get_blocking(key)

    def get_non_blocking(self, key: CacheEngineKey) -> Future | None:
        self._expire_due()
        return self.inner.get_non_blocking(key)

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        self._expire_due()
        return self.inner.batched_get_blocking(keys)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        self._expire_due()
        return await self.inner.batched_get_non_blocking(lookup_id, keys, transfer_spec)

    def pin(self, key: CacheEngineKey) -> bool:
        return self.inner.pin(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.inner.unpin(key)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.inner.remove(key, force)

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        return self.inner.batched_remove(keys, force)

    def touch_cache(self) -> None:
        self._expire_due()
        self.inner.touch_cache()

    def cancel_request(self, req_id: str) -> None:
        self.inner.cancel_request(req_id)

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        return self.inner.get_allocator_backend()

    def close(self) -> None:
        self.inner.close()
        with self._lock:
            limited = list(self._expiry)
            self._expiry.clear()
            self._heap.clear()
        # A retention-limited copy must not outlive the process that can expire it.
        removed = sum(bool(self.inner.remove(key)) for key in limited)
        if removed:
            logger.info("%s deleted %d retention-limited chunk(s) at shutdown", self, removed)


class _DiskSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: Path
    max_size_gb: float = Field(gt=0.0)


class _RemoteSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    url: str = Field(min_length=1)


def disk_settings(extra_config: Mapping[str, Any] | None) -> _DiskSettings:
    """GatedLocalDiskBackend's settings; errors name the extra_config key."""
    extra = extra_config or {}
    for key in (LOCAL_DISK_KEY, LOCAL_DISK_SIZE_KEY):
        if extra.get(key) is None:
            raise ValueError(f"GatedLocalDiskBackend needs LMCache extra_config.{key}")
    try:
        return _DiskSettings(path=extra[LOCAL_DISK_KEY], max_size_gb=extra[LOCAL_DISK_SIZE_KEY])
    except ValidationError as exc:
        raise ValueError(
            f"invalid LMCache extra_config.{LOCAL_DISK_KEY}/{LOCAL_DISK_SIZE_KEY}: {exc}"
        ) from None


def remote_settings(extra_config: Mapping[str, Any] | None) -> _RemoteSettings:
    """GatedRemoteBackend's settings; errors name the extra_config key."""
    url = (extra_config or {}).get(REMOTE_URL_KEY)
    if not isinstance(url, str) or not url:
        raise ValueError(
            f"GatedRemoteBackend needs LMCache extra_config.{REMOTE_URL_KEY} (an LMCache remote "
            "URL)"
        )
    return _RemoteSettings(url=url)


def _inner_config(config: LMCacheEngineConfig, **settings: Any) -> LMCacheEngineConfig:
    # A detached copy: the tier is configured for the wrapped backend only, never for LMCache's
    # own backend factory, which would build it ungated.
    return LMCacheEngineConfig.from_dict({**config.to_dict(), **settings})


def _needs_cpu_backend(local_cpu_backend: LocalCPUBackend | None, name: str) -> LocalCPUBackend:
    if local_cpu_backend is None:
        raise ValueError(
            f"{name} needs LMCache's local CPU backend as its buffer (max_local_cpu_size > 0)"
        )
    return local_cpu_backend


class GatedLocalDiskBackend(GatedStorageBackend):
    def __init__(
        self,
        config: LMCacheEngineConfig,
        dst_device: str,
        metadata: LMCacheMetadata,
        local_cpu_backend: LocalCPUBackend | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        settings = disk_settings(config.extra_config)
        _remove_leftovers(settings.path, metadata)
        inner = LocalDiskBackend(
            _inner_config(
                config, local_disk=str(settings.path), max_local_disk_size=settings.max_size_gb
            ),
            loop,
            _needs_cpu_backend(local_cpu_backend, type(self).__name__),
            dst_device,
            None,
            metadata,
        )
        super().__init__(inner, keeps_finite_retention=True)


def _remove_leftovers(folder: Path, metadata: LMCacheMetadata) -> None:
    """Delete this worker's chunk files left by an earlier process (one that crashed before its
    shutdown cleanup): LocalDiskBackend never reads them again, and they may hold copies whose
    retention has expired. Names follow LocalDiskBackend._key_to_path:
    `model@world_size@worker_id@hash@dtype[@tag%value...].pt`, with "/" written as "-"."""
    if not folder.is_dir():
        return
    prefix = metadata.model_name.replace("/", "-") + "@"
    removed = 0
    for path in folder.iterdir():
        name = path.name
        if not (name.startswith(prefix) and name.endswith(".pt") and path.is_file()):
            continue
        fields = name[len(prefix):].split("@")
        if len(fields) > 1 and fields[1] == str(metadata.worker_id):
            path.unlink()
            removed += 1
    if removed:
        logger.warning(
            "GatedLocalDiskBackend deleted %d chunk file(s) left in %s by an earlier process",
            removed,
            folder,
        )


class GatedRemoteBackend(GatedStorageBackend):
    def __init__(
        self,
        config: LMCacheEngineConfig,
        dst_device: str,
        metadata: LMCacheMetadata,
        local_cpu_backend: LocalCPUBackend | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        settings = remote_settings(config.extra_config)
        inner = RemoteBackend(
            _inner_config(config, remote_url=settings.url),
            metadata,
            loop,
            _needs_cpu_backend(local_cpu_backend, type(self).__name__),
            dst_device,
        )
        super().__init__(inner, keeps_finite_retention=False)


GATED_BACKENDS: dict[str, str] = {
    GatedLocalDiskBackend.__name__: "local_disk",
    GatedRemoteBackend.__name__: "remote",
}
