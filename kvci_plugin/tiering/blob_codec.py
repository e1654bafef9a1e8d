"""The bytes of one page blob, the same in every blob backend: encode, decode, verify.

A blob is a safetensors document holding one 1-D uint8 tensor ``page`` and string metadata:
format, namespace, key, tenant, byte length, created, and a checksum. The checksum covers a
canonical encoding of every other metadata field followed by the page bytes, so a flipped byte
anywhere in the data or in the fields that decide who may read it (tenant, namespace, key) is
caught. It is XXH3-128: it guards against corruption (bit rot, torn or misplaced files), which a
128-bit hash misses with odds of 2^-128; a cryptographic hash would add nothing, since anyone who
can write a blob can recompute any unkeyed digest. Verifying is on every disk hit's path, and
XXH3 reads ~9 GB/s here against SHA-256's 1.4 GB/s (SHA-256 verification was 40% of a 32 MiB
load). Blobs written with SHA-256 (the first format) still verify.

Every backend decodes and verifies what it reads before a byte of it is used: a node never
trusts another node's bytes, nor a shared folder's or a Redis server's.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash
from safetensors.torch import save as save_safetensors

from kvci_plugin.tiering.types import PageKey, TenantMismatchError

FORMAT = "kvci.page.v1"
NAMESPACE_BYTES = 32
TENSOR = "page"
_CHECKSUM_ALGO = "xxh3-128"
# Every algorithm a stored checksum may name: what ``encode`` writes, and what it wrote before.
_HASHES: dict[str, Callable[[], Any]] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_METADATA_FIELDS = frozenset(
    {"format", "namespace", "key", "tenant", "bytes", "created", "checksum"}
)
# A page blob's header is a few hundred bytes; a larger length prefix is corruption.
_MAX_HEADER = 1 << 16


class BlobUnavailableError(Exception):
    """A page's blob cannot be served: a miss for the caller, never partial or foreign bytes."""


class BlobMissingError(BlobUnavailableError):
    """No blob exists for the key."""


class BlobIntegrityError(BlobUnavailableError):
    """The blob failed verification and was moved to quarantine."""


def check_namespace(namespace: object) -> bytes:
    """Return ``namespace`` if it is the 32-byte namespace fingerprint; raise otherwise."""
    if not isinstance(namespace, bytes):
        raise TypeError(f"namespace must be bytes, not {type(namespace).__name__}")
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, not {len(namespace)}")
    return namespace


def check_page(data: object, field_name: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{field_name} must be a torch.Tensor, not {type(data).__name__}")
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"{field_name} must be a 1-D uint8 tensor, not {data.dim()}-D {data.dtype}"
        )
    if data.numel() == 0:
        raise ValueError(f"{field_name} must not be empty")
    return data


def checksum(
    metadata: dict[str, str], page: np.ndarray | memoryview, algorithm: str = _CHECKSUM_ALGO
) -> str:
    fields = {k: v for k, v in metadata.items() if k != "checksum"}
    digest = _HASHES[algorithm]()
    digest.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    digest.update(b"\0")
    digest.update(page)
    return f"{algorithm}:{digest.hexdigest()}"


def encode(namespace: bytes, key: PageKey, tenant: str, page: torch.Tensor) -> bytes:
    """The blob of ``page`` (a 1-D uint8 CPU tensor), checksummed."""
    metadata = {
        "format": FORMAT,
        "namespace": namespace.hex(),
        "key": key.hex(),
        "tenant": tenant,
        "bytes": str(page.numel()),
        "created": repr(time.time()),
    }
    metadata["checksum"] = checksum(metadata, page.numpy())
    return save_safetensors({TENSOR: page.contiguous()}, metadata=metadata)


def decode(blob: bytes | memoryview, namespace: bytes, key: PageKey) -> tuple[str, np.ndarray]:
    """(tenant, page bytes) of a blob that verifies as ``key``'s page in ``namespace``; the
    page is a read-only view into ``blob``.

    Raises ``BlobIntegrityError`` naming the first problem otherwise. The tenant is returned,
    not checked: the caller decides what another tenant's intact blob means.
    """
    metadata, page = _parse(blob)
    problem = _verify(namespace, key, metadata, page)
    if problem is not None:
        raise BlobIntegrityError(f"blob of page {key.hex()}: {problem}")
    return metadata["tenant"], page


def open_page(
    blob: bytes | memoryview,
    namespace: bytes,
    key: PageKey,
    tenant: str,
    out: torch.Tensor | None,
    quarantine: Callable[[], None],
) -> torch.Tensor:
    """The page of a stored blob for ``tenant``, copied into ``out`` when given, only once it
    has verified; a blob that does not verify is handed to ``quarantine`` and refused."""
    try:
        owner, page = decode(blob, namespace, key)
    except BlobIntegrityError as exc:
        quarantine()
        raise BlobIntegrityError(f"{exc}; quarantined") from None
    if owner != tenant:
        raise TenantMismatchError(f"page {key.hex()} belongs to another tenant")
    if out is None:
        return torch.from_numpy(page.copy())
    if out.numel() != page.size:
        raise ValueError(f"out holds {out.numel()} bytes, the page {page.size}")
    np.copyto(out.numpy(), page)
    return out


def _parse(blob: bytes | memoryview) -> tuple[dict[str, str], np.ndarray]:
    """The metadata and the page bytes of a blob in the safetensors layout ``encode`` writes.

    Read in place rather than by ``safetensors.torch.load``, which copies the data twice (a
    third of a disk hit's time): a page blob holds one 1-D uint8 tensor, so the layout check is
    short, and ``_verify`` checks every byte against the checksum before any is used.
    """
    if len(blob) < 8:
        raise BlobIntegrityError("blob is truncated")
    header_len = int.from_bytes(blob[:8], "little")
    if header_len > min(_MAX_HEADER, len(blob) - 8):
        raise BlobIntegrityError(f"blob header length {header_len} is impossible")
    try:
        header = json.loads(bytes(blob[8 : 8 + header_len]))  # a memoryview too
    except (ValueError, UnicodeDecodeError) as exc:
        raise BlobIntegrityError(f"blob header does not parse: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"__metadata__", TENSOR}:
        raise BlobIntegrityError(f"blob must hold exactly one tensor named {TENSOR!r}")
    metadata, entry = header["__metadata__"], header[TENSOR]
    data_len = len(blob) - 8 - header_len
    if (not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
            or not isinstance(entry, dict) or entry.get("dtype") != "U8"
            or entry.get("shape") != [data_len] or entry.get("data_offsets") != [0, data_len]):
        raise BlobIntegrityError(f"blob tensor {TENSOR!r} is not 1-D uint8 filling the blob")
    return metadata, np.frombuffer(blob, dtype=np.uint8, offset=8 + header_len)


def _verify(
    namespace: bytes, key: PageKey, metadata: dict[str, str], page: np.ndarray
) -> str | None:
    if set(metadata) != _METADATA_FIELDS:
        return f"metadata fields {sorted(metadata)} are not {sorted(_METADATA_FIELDS)}"
    if metadata["format"] != FORMAT:
        return f"format {metadata['format']!r} is not {FORMAT!r}"
    if metadata["namespace"] != namespace.hex():
        return "it belongs to another namespace"
    if metadata["key"] != key.hex():
        return "it holds another page"
    if str(page.size) != metadata["bytes"]:
        return f"the tensor is not {metadata['bytes']} bytes"
    algorithm = metadata["checksum"].partition(":")[0]
    if algorithm not in _HASHES:
        return f"checksum algorithm {algorithm!r} is not one of {sorted(_HASHES)}"
    if metadata["checksum"] != checksum(metadata, page, algorithm):
        return "checksum mismatch"
    return None
