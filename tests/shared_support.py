"""Helpers for the shared-tier tests that child processes import too (spawned children cannot
import a test module)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

from kvci_plugin.tiering.blobs.backend import BlobRoot
from kvci_plugin.tiering.blobs.factory import open_blob_root

NS = hashlib.sha256(b"shared-ns").digest()
OTHER_NS = hashlib.sha256(b"other-ns").digest()
SLOT = 512


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"key-{i}".encode()).digest()[:16]


def page_of(key: bytes, salt: bytes = b"") -> torch.Tensor:
    return torch.frombuffer(
        bytearray(hashlib.shake_128(salt + key).digest(SLOT)), dtype=torch.uint8
    )


class Location:
    """A blob location under test, with raw access to its stored bytes."""

    def __init__(self, kind: str, address: str) -> None:
        self.kind = kind
        self.address = address

    def open(self) -> BlobRoot:
        if self.kind == "folder":
            return open_blob_root(None, Path(self.address))
        return open_blob_root(self.address, None)

    def _path(self, ns: bytes, key: bytes) -> Path:
        return (
            Path(self.address)
            / "blobs"
            / ns.hex()[:32]
            / key.hex()[:2]
            / f"{key.hex()}.safetensors"
        )

    def _name(self, ns: bytes, key: bytes) -> str:
        return f"kvci:blob:{ns.hex()[:32]}:{key.hex()}"

    def raw(self, ns: bytes, key: bytes) -> bytes | None:
        if self.kind == "folder":
            path = self._path(ns, key)
            return path.read_bytes() if path.exists() else None
        return redis.Redis.from_url(self.address).get(self._name(ns, key))

    def plant(self, ns: bytes, key: bytes, blob: bytes) -> None:
        if self.kind == "folder":
            path = self._path(ns, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)
        else:
            redis.Redis.from_url(self.address).set(self._name(ns, key), blob)


def hammer(kind: str, address: str, salt: bytes, rounds: int) -> None:
    store = Location(kind, address).open().store(NS)
    key = key_of(0)
    for i in range(rounds):
        store.delete(key)  # forces a real rewrite each round, racing the other writers
        store.write(key, "alice", page_of(key, salt + bytes([i])))


def open_node(kind: str, address: str, catalog_url: str, *, disk_bytes: int = 1 << 30,
              lease_s: float = 600.0, clock: Callable[[], float] = time.time):
    """One node's view of the shared disk tier (``clock``: that node's, which may be skewed)."""
    from support.disk_tier import DiskTierForTests

    if kind == "folder":
        return DiskTierForTests(Path(address), NS, disk_bytes, clock, catalog_url=catalog_url,
                                 lease_s=lease_s)
    return DiskTierForTests(None, NS, disk_bytes, clock, catalog_url=catalog_url,
                             blob_url=address, lease_s=lease_s)


def checkpoint_keys(node: int, i: int) -> list[bytes]:
    """Four pages every node shares, then two of this checkpoint's own."""
    return [key_of(j) for j in range(4)] + [key_of(1000 * (node + 1) + 2 * i + j) for j in (0, 1)]


def persist_many(kind: str, address: str, catalog_url: str, node: int, count: int,
                 report: str, lease_s: float) -> None:
    """A node persisting ``count`` overlapping checkpoints, appending each id to ``report``
    once ``persist`` has returned (so the id is durable)."""
    import os

    store = open_node(kind, address, catalog_url, lease_s=lease_s)
    with open(report, "a") as out:
        for i in range(count):
            keys = checkpoint_keys(node, i)
            store.persist(f"n{node}-{i}", "alice", keys, torch.stack([page_of(k) for k in keys]),
                          "agent", "{}", "{}", None)
            out.write(f"n{node}-{i}\n")
            out.flush()
            os.fsync(out.fileno())
