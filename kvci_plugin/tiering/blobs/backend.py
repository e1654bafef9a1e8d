"""Where page blobs live: the interface every blob backend keeps (``factory`` picks one).

Two backends: a folder (``folder.BlobStore``: local disk, or a POSIX folder shared by many
nodes such as NFS, Lustre or CephFS) and Redis/Valkey (``redis_store.RedisBlobStore``).
Both store the same sealed blob bytes (``codec``) under the page key, so the rules above
them — blobs durable before their catalog row, rows gone before their blobs, verify on every
read — do not depend on which one is configured.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvci_plugin.tiering.blobs.errors import BlobUnavailableError
from kvci_plugin.tiering.blobs.tenant_keys import PageSeal, TenantKeys
from kvci_plugin.tiering.types import PageKey, TenantMismatchError


@dataclass(frozen=True)
class StoredBlob:
    """A blob found by a listing: its namespace (first 16 bytes, hex), key (hex) and age."""

    namespace_prefix: str
    key_hex: str
    age_s: float


class BlobBackend(Protocol):
    """The blobs of one namespace."""

    @property
    def namespace(self) -> bytes: ...

    def exists(self, key: PageKey) -> bool: ...

    def size(self, key: PageKey) -> int: ...

    def delete(self, key: PageKey) -> bool: ...

    def write(self, key: PageKey, tenant: str, data: torch.Tensor) -> int: ...

    def write_many(
        self, keys: Sequence[PageKey], tenant: str, pages: torch.Tensor
    ) -> list[int]: ...

    def read(
        self, key: PageKey, tenant: str, out: torch.Tensor | None = None,
        seal: PageSeal | None = None,
    ) -> torch.Tensor: ...

    @property
    def keys(self) -> TenantKeys: ...

    def read_many(
        self, keys: Sequence[PageKey], tenant: str, out: torch.Tensor
    ) -> tuple[int, BlobUnavailableError | TenantMismatchError | None]: ...

    def quarantined(self) -> int: ...


class BlobRoot(Protocol):
    """A blob location shared by every namespace: a folder or a Redis database."""

    def describe(self) -> str: ...

    def store(self, namespace: bytes) -> BlobBackend: ...

    def listing(self) -> Iterator[StoredBlob]: ...

    def remove(self, blob: StoredBlob) -> None: ...

    def sweep_temps(self, min_age_s: float) -> int: ...

    def close(self) -> None: ...

    @property
    def keys(self) -> TenantKeys: ...
