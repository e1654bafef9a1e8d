"""The facade starts only on an LMCache configuration whose every tier beyond CPU memory is
gated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.config import LMCacheEngineConfig
from lmcache_support import GATED_MODULE, lmcache_settings

from kvci_plugin.lmcache.config import KVCILMCacheConfig
from kvci_plugin.lmcache.gated_tiers import GatedTiers
from kvci_plugin.lmcache.lmcache_config import gated_tiers


def _config(**settings: Any) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(**settings)


def test_plain_cpu_caching_has_no_durable_tier():
    assert gated_tiers(_config(**lmcache_settings())) == GatedTiers()


def test_the_gated_plugins_are_recognised(tmp_path: Path):
    assert gated_tiers(_config(**lmcache_settings(disk=tmp_path))) == GatedTiers(local_disk=True)
    assert gated_tiers(_config(**lmcache_settings(remote="lm://localhost:65432"))) == GatedTiers(
        remote=True
    )
    both = gated_tiers(_config(**lmcache_settings(disk=tmp_path, remote="lm://localhost:65432")))
    assert both == GatedTiers(local_disk=True, remote=True)


@pytest.mark.parametrize(("setting", "value"), [
    ("local_disk", "/tmp/lmcache-disk"),
    ("remote_url", "lm://localhost:65432"),
    ("remote_storage_plugins", ["redis"]),
    ("gds_path", "/tmp/gds"),
    ("maru_path", "/dev/maru"),
    ("enable_p2p", True),
    ("enable_pd", True),
])
def test_every_ungated_tier_is_refused_by_name(setting: str, value: Any):
    with pytest.raises(ValueError, match=setting):
        gated_tiers(_config(**{**lmcache_settings(), setting: value}))


def test_nixl_storage_is_refused():
    with pytest.raises(ValueError, match="enable_nixl_storage"):
        gated_tiers(
            _config(**{**lmcache_settings(), "extra_config": {"enable_nixl_storage": True}})
        )


def test_a_foreign_storage_plugin_is_refused(tmp_path: Path):
    settings = lmcache_settings(disk=tmp_path)
    settings["storage_plugins"] = ["kvci_disk", "mine"]
    settings["extra_config"].update({"storage_plugin.mine.module_path": "my_backends",
                                     "storage_plugin.mine.class_name": "FastDisk"})
    with pytest.raises(ValueError, match="'mine'"):
        gated_tiers(_config(**settings))


def test_a_gated_class_name_from_another_module_is_refused(tmp_path: Path):
    settings = lmcache_settings(disk=tmp_path)
    settings["extra_config"]["storage_plugin.kvci_disk.module_path"] = "elsewhere.gated_backend"
    with pytest.raises(ValueError, match="kvci_disk"):
        gated_tiers(_config(**settings))


@pytest.mark.parametrize("missing", ["kvci.gated_local_disk", "kvci.gated_max_local_disk_size"])
def test_the_gated_disk_needs_its_folder_and_bound(tmp_path: Path, missing: str):
    settings = lmcache_settings(disk=tmp_path)
    del settings["extra_config"][missing]
    with pytest.raises(ValueError, match=missing):
        gated_tiers(_config(**settings))


def test_the_gated_remote_needs_its_url():
    settings = lmcache_settings(remote="lm://localhost:65432")
    del settings["extra_config"]["kvci.gated_remote_url"]
    with pytest.raises(ValueError, match="kvci.gated_remote_url"):
        gated_tiers(_config(**settings))


def test_gated_tiers_need_the_cpu_buffer(tmp_path: Path):
    with pytest.raises(ValueError, match="max_local_cpu_size"):
        gated_tiers(_config(**{**lmcache_settings(disk=tmp_path), "max_local_cpu_size": 0}))


def test_listing_a_gated_plugin_twice_is_refused(tmp_path: Path):
    settings = lmcache_settings(disk=tmp_path)
    settings["storage_plugins"].append("kvci_disk2")
    settings["extra_config"].update(
        {
            "storage_plugin.kvci_disk2.module_path": GATED_MODULE,
            "storage_plugin.kvci_disk2.class_name": "GatedLocalDiskBackend",
        }
    )
    with pytest.raises(ValueError, match="twice"):
        gated_tiers(_config(**settings))


def test_the_remote_tier_accepts_only_copies_without_a_retention_limit():
    tiers = GatedTiers(local_disk=True, remote=True)
    assert tiers.accepting(None) == ("local_disk", "remote")
    assert tiers.accepting(1.0e12) == ("local_disk",)
    assert GatedTiers(remote=True).accepting(1.0e12) == ()


def test_kvci_settings_reject_unknown_keys_and_inconsistent_values(tmp_path: Path):
    assert KVCILMCacheConfig.from_extra_config({"lmcache.chunk_size": 256}) == KVCILMCacheConfig()
    with pytest.raises(ValueError, match="ram_bytes"):
        KVCILMCacheConfig.from_extra_config({"kvci": {"ram_bytes": "1GiB"}})
    with pytest.raises(ValueError, match="revocation_db needs credentials"):
        KVCILMCacheConfig.from_extra_config({"kvci": {"revocation_db": str(tmp_path / "r.db")}})
    with pytest.raises(ValueError, match="label_catalog_json needs label_catalog"):
        KVCILMCacheConfig.from_extra_config(
            {"kvci": {"label_catalog_json": str(tmp_path / "l.json")}}
        )
    with pytest.raises(ValueError, match="ram_threshold cannot exceed disk_threshold"):
        KVCILMCacheConfig.from_extra_config({"kvci": {"ram_threshold": 0.9, "disk_threshold": 0.8}})
    with pytest.raises(TypeError, match="must be an object"):
        KVCILMCacheConfig.from_extra_config({"kvci": ["system_trigger"]})
