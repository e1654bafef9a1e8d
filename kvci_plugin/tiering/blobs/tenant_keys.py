"""The keys that seal page blobs: one per (tenant, namespace), and how a tenant is forgotten.

Two parts make a key, held in different places, so that neither alone opens a blob:

- the **root key** of the node, from a ``RootKeyProvider``: ``StateDirRootKey`` (the node's
  ``state_dir/secret``, the same file the prefix keys come from, made on first use) or
  ``KeyFileRootKey`` (a file a KMS agent or an operator writes; the seam for a KMS). Every node
  that shares a disk tier needs the same root key, as it needs the same prefix-key secret.
- the **tenant material**: 32 random bytes per tenant, created at its first write and kept in
  the blob location itself (``TenantMaterials``: a 0600 file beside the blobs, or a Redis
  value), so every node sharing the blobs derives the same keys without sharing anything else.

key(tenant, namespace) = HKDF-SHA256(ikm=root key, salt=material, info=FORMAT, namespace,
tenant). ``forget`` destroys the material, leaving a tombstone in its place: from then on no
node can derive the tenant's keys, whoever still holds the root key and a copy of the blobs
(crypto-erasure). A writer creates material only where none ever was; over a tombstone only a
new write registered after the forget (``ensure``, the disk tier's ``reserve``) does, so a write
still under way at the forget fails instead of making material that would open what it wrote.
A blob names its tenant by ``tenant_id``, an HMAC of the name under the root key, so stored names
reveal nothing.

Keys live in memory only. Nothing here puts a key, the root key or material in a message: the
classes' reprs omit them.
"""

from __future__ import annotations

import hmac
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvci_plugin.tiering.blobs.errors import BlobUnavailableError
from kvci_plugin.tiering.secret import DEFAULT_STATE_DIR, load_or_create_secret, read_key_file
from kvci_plugin.tiering.types import check_tenant

KEY_FORMAT = b"kvci.page.v2"
"""Bound into every key: a new blob format derives new keys."""

MATERIAL_BYTES = 32
TENANT_ID_BYTES = 16
TOMBSTONE = b"kvci:forgotten"
"""What a forget leaves in place of a tenant's material (never a valid material: its length)."""


class TenantKeyUnavailableError(BlobUnavailableError):
    """The tenant has no key material (never written, or forgotten): its blobs cannot be opened.

    A miss, never a reason to quarantine: the blob may be intact and simply unreadable now.
    """


class RootKeyProvider(Protocol):
    """Where a node's root key comes from (a KMS implements this)."""

    def root_key(self) -> bytes: ...


@dataclass(frozen=True)
class StateDirRootKey:
    """The root key is the node's ``state_dir/secret`` (created 0600 on first use)."""

    state_dir: Path = DEFAULT_STATE_DIR

    def root_key(self) -> bytes:
        return load_or_create_secret(Path(self.state_dir))


@dataclass(frozen=True)
class KeyFileRootKey:
    """The root key is the content of ``path`` (0600, owned by this user, >= 16 bytes)."""

    path: Path

    def root_key(self) -> bytes:
        return read_key_file(Path(self.path))


class TenantMaterials(Protocol):
    """Tenant key material in a blob location, by tenant id (hex)."""

    def read_material(self, tenant_id: str) -> bytes | None: ...

    def create_material(self, tenant_id: str, material: bytes) -> bytes:
        """Store ``material`` unless some (or a tombstone) is there already; return what is
        stored."""
        ...

    def renew_material(self, tenant_id: str, material: bytes) -> bytes:
        """Replace a ``TOMBSTONE`` with ``material`` (nothing else); return what is stored."""
        ...

    def destroy_material(self, tenant_id: str) -> bool:
        """Put a ``TOMBSTONE`` in place of the material; whether there was material."""
        ...


class MemoryMaterials:
    """Tenant key material held in memory, for one process whose keys need not outlive it
    (benchmarks and tests of the codec)."""

    def __init__(self) -> None:
        self._held: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return f"MemoryMaterials({len(self._held)} tenants)"

    def read_material(self, tenant_id: str) -> bytes | None:
        return self._held.get(tenant_id)

    def create_material(self, tenant_id: str, material: bytes) -> bytes:
        return self._held.setdefault(tenant_id, material)

    def renew_material(self, tenant_id: str, material: bytes) -> bytes:
        if self._held.get(tenant_id) == TOMBSTONE:
            self._held[tenant_id] = material
        return self._held[tenant_id]

    def destroy_material(self, tenant_id: str) -> bool:
        previous = self._held.get(tenant_id)
        self._held[tenant_id] = TOMBSTONE
        return previous not in (None, TOMBSTONE)


@dataclass(frozen=True)
class PageSeal:
    """What seals and opens one tenant's pages in one namespace: its tenant id and AEAD key."""

    tenant_id: str
    key: bytes = field(repr=False)

    def blob_cipher(self, salt: bytes) -> AESGCM:
        """The cipher of one blob: a key of its own from the blob's random salt, so nonces (the
        segment index) never repeat under one key however many blobs a tenant writes."""
        return AESGCM(hmac.digest(self.key, b"kvci-blob\0" + salt, "sha256"))


class TenantKeys:
    """Derives page seals for a blob location. Thread-safe."""

    def __init__(self, root_key: bytes, materials: TenantMaterials) -> None:
        if not isinstance(root_key, bytes) or len(root_key) < 16:
            raise ValueError("a root key must be at least 16 bytes")
        self._root = root_key
        self._materials = materials
        self._lock = threading.Lock()
        # (material, namespace, tenant) -> seal: material is read on every use (a forget on
        # another node must take effect at once); only the derivation is cached.
        self._seals: dict[tuple[bytes, bytes, str], PageSeal] = {}
        self._ids: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"TenantKeys({type(self._materials).__name__})"

    def tenant_id(self, tenant: str) -> str:
        """The name a blob and the material give the tenant: an HMAC, so it reveals nothing."""
        found = self._ids.get(tenant)
        if found is None:
            check_tenant(tenant)
            mac = hmac.digest(self._root, b"kvci-tenant-id\0" + tenant.encode(), "sha256")
            found = self._ids[tenant] = mac[:TENANT_ID_BYTES].hex()
        return found

    def for_read(self, tenant: str, namespace: bytes) -> PageSeal:
        """The seal of ``tenant``'s pages; ``TenantKeyUnavailableError`` without material."""
        material = self._materials.read_material(self.tenant_id(tenant))
        if material is None:
            raise TenantKeyUnavailableError("the tenant has no key material here (never written)")
        return self._seal(material, namespace, tenant)

    def for_write(self, tenant: str, namespace: bytes) -> PageSeal:
        """The seal of ``tenant``'s pages, creating its material where none ever was; after a
        forget, only ``ensure`` makes it again."""
        tid = self.tenant_id(tenant)
        material = self._materials.read_material(tid)
        if material is None:
            material = self._materials.create_material(tid, os.urandom(MATERIAL_BYTES))
        return self._seal(material, namespace, tenant)

    def ensure(self, tenant: str) -> None:
        """Make ``tenant``'s material, over a forget's tombstone too: for a write registered
        now (the disk tier's ``reserve``), before any of its blobs is written."""
        tid = self.tenant_id(tenant)
        material = self._materials.read_material(tid)
        if material is None:
            self._materials.create_material(tid, os.urandom(MATERIAL_BYTES))
        elif material == TOMBSTONE:
            self._materials.renew_material(tid, os.urandom(MATERIAL_BYTES))

    def forget(self, tenant: str) -> bool:
        """Destroy ``tenant``'s material: no node derives its keys again. False if none."""
        tid = self.tenant_id(tenant)
        with self._lock:
            self._seals = {k: v for k, v in self._seals.items() if v.tenant_id != tid}
        return self._materials.destroy_material(tid)

    def _seal(self, material: bytes, namespace: bytes, tenant: str) -> PageSeal:
        if material == TOMBSTONE:
            raise TenantKeyUnavailableError("the tenant was forgotten: its key material is gone")
        if len(material) != MATERIAL_BYTES:
            raise TenantKeyUnavailableError("the tenant's key material is damaged")
        cache_key = (material, namespace, tenant)
        seal = self._seals.get(cache_key)
        if seal is None:
            info = b"\0".join([KEY_FORMAT, namespace, tenant.encode()])
            key = HKDF(algorithm=hashes.SHA256(), length=32, salt=material, info=info).derive(
                self._root
            )
            seal = PageSeal(self.tenant_id(tenant), key)
            with self._lock:
                self._seals[cache_key] = seal
        return seal
