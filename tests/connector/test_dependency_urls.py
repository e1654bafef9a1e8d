"""Dependency URLs carry no secret: a password in catalog_url or blob_url is refused without
being echoed, and the password comes from an owner-only file, put into the URL in memory only —
tried against a real Redis that requires one."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import redis
import torch
from pydantic import ValidationError
from services import _stop, _wait, free_port

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.dependency_urls import redacted, with_password
from kvci_plugin.tiering.blobs.factory import open_blob_root

SECRET = "s3cret/with:odd@chars"


@pytest.mark.parametrize("key,url", [
    ("catalog_url", "postgresql://kvci:s3cret@db.example/kvci"),
    ("blob_url", "redis://:s3cret@cache.example:6379/0"),
    ("blob_url", "unix:///run/redis.sock?db=0&password=s3cret"),
])
def test_a_url_carrying_a_password_is_refused_without_echoing_it(tmp_path: Path, key: str,
                                                                 url: str) -> None:
    config = {"disk_root": str(tmp_path), key: url}
    if key == "blob_url":
        config["catalog_url"] = "postgresql://db.example/kvci"
    with pytest.raises(ValidationError) as refused:
        KVCIConfig.model_validate(config)
    assert "password_file" in str(refused.value) and "s3cret" not in str(refused.value)


def test_the_password_comes_from_an_owner_only_file(tmp_path: Path) -> None:
    secret = tmp_path / "pg.password"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o644)
    config = KVCIConfig.model_validate({
        "disk_root": str(tmp_path), "catalog_url": "postgresql://kvci@db.example:5432/kvci",
        "catalog_password_file": str(secret)})
    assert SECRET not in config.model_dump_json()
    with pytest.raises(PermissionError, match="owner only"):
        config.catalog_dsn()  # readable by others: refused, as every secret file kvci reads
    secret.chmod(0o600)
    dsn = config.catalog_dsn()
    assert dsn is not None and SECRET not in dsn  # quoted into the URL
    assert redacted(dsn) == "postgresql://db.example:5432/kvci"
    assert with_password("unix:///run/r.sock?db=1", secret).startswith("unix:///run/r.sock?db=1&")


def test_a_redis_that_requires_a_password_is_reached_with_the_files(tmp_path: Path) -> None:
    binary = shutil.which("redis-server")
    assert binary is not None, "make setup installs redis-server"
    folder = Path(tempfile.mkdtemp(prefix="kvci-redis-auth-"))
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
         "--appendonly", "no", "--requirepass", SECRET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait(lambda: redis.Redis.from_url(url, password=SECRET).ping(), "Redis")
        secret = tmp_path / "redis.password"
        secret.write_text(SECRET)
        secret.chmod(0o600)
        config = KVCIConfig.model_validate({
            "disk_root": str(tmp_path / "disk"), "catalog_url": "postgresql://db.example/kvci",
            "blob_url": url, "blob_password_file": str(secret)})
        page = torch.arange(512, dtype=torch.int64).to(torch.uint8)
        key = bytes(range(16))
        store = open_blob_root(config.blob_dsn(), None).store(bytes(32))
        store.write(key, "acme", page)
        assert torch.equal(store.read(key, "acme"), page)
        with pytest.raises(Exception, match="(?i)auth"):  # the URL alone is not enough
            open_blob_root(config.blob_url, None).store(bytes(32)).read(key, "acme")
    finally:
        _stop(server, folder)
