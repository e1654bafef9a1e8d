"""Refuse an LMCache configuration that would write KV past the eligibility gate.

LMCache writes every saved chunk to every backend it is configured with, so one ungated durable
tier next to kvci's gated ones would take every chunk the gate refused. The facade therefore
checks LMCache's effective configuration before LMCache builds anything, and starts only when
each tier beyond LMCache's own CPU memory is one of kvci's gated backends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.v1.config import LMCacheEngineConfig

from kvci_plugin.lmcache.gated_backend import (
    GATED_BACKENDS,
    GatedStorageBackend,
    disk_settings,
    remote_settings,
)
from kvci_plugin.lmcache.gated_tiers import GatedTiers

_LMCACHE_PREFIX = "lmcache."

# Every LMCache 0.5.6 setting that sends KV beyond this process's memory, and what it does.
_UNGATED: dict[str, str] = {
    "local_disk": "LMCache's own disk tier",
    "remote_url": "LMCache's own remote tier",
    "remote_storage_plugins": "LMCache's own remote tiers",
    "gds_path": "LMCache's GPUDirect storage tier",
    "maru_path": "LMCache's Maru shared-memory tier",
    "enable_p2p": "peer-to-peer sharing with other instances",
    "enable_pd": "disaggregated prefill, whose transfers ignore the per-request save decision",
}
_UNGATED_EXTRA: dict[str, str] = {
    "enable_nixl_storage": "LMCache's NIXL storage tier",
}


def effective_lmcache_config(
    kv_connector_extra_config: Mapping[str, Any] | None,
) -> LMCacheEngineConfig:
    """LMCache's configuration (its file or environment) with the `lmcache.*` keys of vLLM's
    extra config laid over it: the same overlay LMCacheConnectorV1Impl applies at start."""
    base = lmcache_get_or_create_config()
    overlay = {
        key[len(_LMCACHE_PREFIX) :]: value
        for key, value in (kv_connector_extra_config or {}).items()
        if isinstance(key, str) and key.startswith(_LMCACHE_PREFIX)
    }
    return LMCacheEngineConfig.from_dict({**base.to_dict(), **overlay})


def gated_tiers(config: LMCacheEngineConfig) -> GatedTiers:
    """The gated durable tiers `config` sets up; ValueError naming the setting that is not gated."""
    for name, what in _UNGATED.items():
        if getattr(config, name):
            raise ValueError(_refusal(f"{name}={getattr(config, name)!r}", what))
    extra = config.extra_config or {}
    for name, what in _UNGATED_EXTRA.items():
        if extra.get(name):
            raise ValueError(_refusal(f"extra_config.{name}={extra[name]!r}", what))
    kinds: list[str] = []
    for plugin in config.storage_plugins or ():
        module = extra.get(f"storage_plugin.{plugin}.module_path")
        cls = extra.get(f"storage_plugin.{plugin}.class_name")
        kind = GATED_BACKENDS.get(cls) if module == GatedStorageBackend.__module__ else None
        if kind is None:
            raise ValueError(
                _refusal(f"storage_plugins entry {plugin!r} ({module}.{cls})", "a storage plugin")
            )
        if kind in kinds:
            raise ValueError(f"LMCache storage_plugins lists kvci's {cls} twice")
        kinds.append(kind)
    if "local_disk" in kinds:
        disk_settings(extra)
    if "remote" in kinds:
        remote_settings(extra)
    if kinds and config.max_local_cpu_size <= 0:
        raise ValueError("kvci's gated tiers need LMCache's local CPU backend as their buffer "
                         "(max_local_cpu_size > 0)")
    return GatedTiers(local_disk="local_disk" in kinds, remote="remote" in kinds)


def _refusal(setting: str, what: str) -> str:
    return (
        f"LMCache setting {setting} enables {what}, which would receive every saved chunk without "
        "the kvci eligibility gate; use kvci's GatedLocalDiskBackend / GatedRemoteBackend storage "
        "plugins instead (docs/lmcache.md)"
    )
