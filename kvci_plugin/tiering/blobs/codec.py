"""The bytes of one page blob, the same in every blob backend: seal, open, refuse.

A blob is a safetensors document holding one 1-D uint8 tensor ``sealed`` and string metadata:
format, namespace, key, tenant (its ``tenant_id``, an HMAC of the name: stored names reveal
nothing), plaintext bytes, segment size, a random salt and the time it was created. The page is
sealed with AES-256-GCM under its tenant's key for the namespace (``tenant_keys``), in segments
of ``SEGMENT_BYTES``, each sealed with its own nonce (its index, under a key of the blob's own
derived from the salt) and with associated data binding the whole safetensors header (every
metadata field, the tensor's size), the segment's index and the segment count. So a blob
written by anyone without the key, moved to another key, namespace or tenant, reordered,
truncated, extended or with any bit flipped never opens, and the bytes at rest reveal nothing
of the KV.

Opening decrypts straight into the caller's buffer (``AESGCM.decrypt_into``): about the cost of
the copy the checksum format paid anyway (32 MiB: 3.2 ms against 1.0 ms XXH3 + 2.4 ms copy
here); a segment that fails leaves zeros, never unauthenticated bytes.

Blobs of the checksum-only format ``kvci.page.v1`` (before sealing) are refused by name and
quarantined like corruption: anyone who could write the store could have written one, so none
is trusted; the KV they held is recomputed once, and start-up/GC removes them.

Every backend opens what it reads before a byte of it is used: a node never trusts another
node's bytes, nor a shared folder's or a Redis server's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from cryptography.exceptions import InvalidTag

from kvci_plugin.tiering.blobs.errors import BlobIntegrityError
from kvci_plugin.tiering.types import PageKey, TenantMismatchError

if TYPE_CHECKING:
    from kvci_plugin.tiering.blobs.tenant_keys import PageSeal, TenantKeys

FORMAT = "kvci.page.v2"
REFUSED_FORMATS = {"kvci.page.v1": "a checksum-only blob from before pages were sealed"}
NAMESPACE_BYTES = 32
TENSOR = "sealed"
SEGMENT_BYTES = 1 << 20
"""Plaintext bytes per sealed segment: small enough that a segment's tag is checked before the
next is decrypted, large enough that the per-segment call costs nothing."""
TAG_BYTES = 16
SALT_BYTES = 16
_METADATA_FIELDS = frozenset(
    {"format", "namespace", "key", "tenant", "bytes", "segment", "salt", "created"}
)
# A page blob's header is a few hundred bytes; a larger length prefix is corruption.
_MAX_HEADER = 1 << 16
HEADER_ROOM = 1 << 10
"""Room for a header that a reader of many blobs sets aside per blob: more than ``encode``
writes (its metadata's values are of fixed size, but the time's and the page size's digits)."""


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


def sealed_bytes(nbytes: int, segment: int = SEGMENT_BYTES) -> int:
    """The size of the sealed tensor of ``nbytes`` of page: the bytes and a tag per segment."""
    return nbytes + TAG_BYTES * -(-nbytes // segment)


MAX_PAGE_BYTES = 1 << 30
"""The largest page a reader accepts when it is not told the page's size (a 16-token KV block
of a 405B model is 8 MiB a rank): a larger file is refused before any buffer is sized from it."""


def blob_room(nbytes: int) -> int:
    """The bytes a reader sets aside for the blob of an ``nbytes`` page: its sealed tensor, the
    length prefix and ``HEADER_ROOM`` for the header. A larger file is not a blob this code wrote
    (the reader that set the room aside then reads it the slow way, which says why)."""
    return 8 + HEADER_ROOM + sealed_bytes(nbytes)


def encode(seal: PageSeal, namespace: bytes, key: PageKey, page: torch.Tensor) -> bytearray:
    """The sealed blob of ``page`` (a 1-D uint8 CPU tensor) for ``seal``'s tenant."""
    nbytes = page.numel()
    salt = os.urandom(SALT_BYTES)
    metadata = {
        "format": FORMAT,
        "namespace": namespace.hex(),
        "key": key.hex(),
        "tenant": seal.tenant_id,
        "bytes": str(nbytes),
        "segment": str(SEGMENT_BYTES),
        "salt": salt.hex(),
        "created": repr(time.time()),
    }
    size = sealed_bytes(nbytes)
    header = json.dumps(
        {"__metadata__": metadata, TENSOR: {"dtype": "U8", "shape": [size],
                                            "data_offsets": [0, size]}},
        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
    blob = bytearray(8 + len(header) + size)
    blob[:8] = len(header).to_bytes(8, "little")
    blob[8 : 8 + len(header)] = header
    sealed = memoryview(blob)[8 + len(header) :]
    plain = memoryview(page.contiguous().numpy())
    cipher = seal.blob_cipher(salt)
    count = -(-nbytes // SEGMENT_BYTES)
    aad = bytes(header)
    for i in range(count):
        part = plain[i * SEGMENT_BYTES : (i + 1) * SEGMENT_BYTES]
        at = i * (SEGMENT_BYTES + TAG_BYTES)
        cipher.encrypt_into(_nonce(i), part, _aad(aad, i, count),
                            sealed[at : at + len(part) + TAG_BYTES])
    return blob


def open_page(
    blob: bytes | memoryview,
    keys: TenantKeys,
    tenant: str,
    namespace: bytes,
    key: PageKey,
    out: torch.Tensor | None,
    quarantine: Callable[[], None],
    seal: PageSeal | None = None,
) -> torch.Tensor:
    """The page of a stored blob for ``tenant``, decrypted into ``out`` when given; ``seal``:
    the tenant's, when the caller fetched it once for many pages.

    A blob that does not open (bad layout, foreign namespace or key, a refused format, any
    segment failing authentication) is handed to ``quarantine`` and refused with
    ``BlobIntegrityError``; ``out`` then holds zeros. An intact-looking blob of another tenant
    raises ``TenantMismatchError`` and a tenant without key material ``TenantKeyUnavailableError``
    (neither is quarantined: the blob may be sound).
    """
    try:
        metadata, header, sealed = _parse(blob)
        problem = _check(namespace, key, metadata, sealed)
        if problem is not None:
            raise BlobIntegrityError(f"blob of page {key.hex()}: {problem}")
    except BlobIntegrityError as exc:
        quarantine()
        raise BlobIntegrityError(f"{exc}; quarantined") from None
    if metadata["tenant"] != keys.tenant_id(tenant):
        raise TenantMismatchError(f"page {key.hex()} belongs to another tenant")
    seal = seal or keys.for_read(tenant, namespace)
    nbytes = int(metadata["bytes"])
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    elif out.numel() != nbytes:
        raise ValueError(f"out holds {out.numel()} bytes, the page {nbytes}")
    if not _decrypt_into(seal, metadata, header, sealed, out.numpy()):
        quarantine()
        raise BlobIntegrityError(
            f"blob of page {key.hex()}: authentication failed (forged, moved or damaged); "
            "quarantined")
    return out


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "big")


def _aad(header: bytes, index: int, count: int) -> bytes:
    return header + index.to_bytes(4, "big") + count.to_bytes(4, "big")


def _decrypt_into(seal: PageSeal, metadata: dict[str, str], header: bytes, sealed: memoryview,
                  out: np.ndarray) -> bool:
    """Open every segment into ``out``; False (and ``out`` zeroed) if any fails."""
    nbytes, segment = int(metadata["bytes"]), int(metadata["segment"])
    cipher = seal.blob_cipher(bytes.fromhex(metadata["salt"]))
    count = -(-nbytes // segment)
    target = memoryview(out)
    try:
        for i in range(count):
            at = i * (segment + TAG_BYTES)
            size = min(segment, nbytes - i * segment)
            cipher.decrypt_into(_nonce(i), sealed[at : at + size + TAG_BYTES],
                                _aad(header, i, count), target[i * segment : i * segment + size])
    except InvalidTag:
        out.fill(0)  # the failed segment's bytes were never authenticated
        return False
    return True


def _parse(blob: bytes | memoryview) -> tuple[dict[str, str], bytes, memoryview]:
    """The metadata, the header and the sealed bytes of a blob in the safetensors layout
    ``encode`` writes.

    Read in place rather than by ``safetensors.torch.load``, which copies the data twice: a page
    blob holds one 1-D uint8 tensor, so the layout check is short, and every sealed byte is
    authenticated before any of it is used.
    """
    if len(blob) < 8:
        raise BlobIntegrityError("blob is truncated")
    header_len = int.from_bytes(blob[:8], "little")
    if header_len > min(_MAX_HEADER, len(blob) - 8):
        raise BlobIntegrityError(f"blob header length {header_len} is impossible")
    raw = bytes(blob[8 : 8 + header_len])
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BlobIntegrityError(f"blob header does not parse: {exc}") from None
    if not isinstance(header, dict) or "__metadata__" not in header:
        raise BlobIntegrityError("blob header has no metadata")
    metadata = header["__metadata__"]
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BlobIntegrityError("blob metadata is not text")
    refused = REFUSED_FORMATS.get(metadata.get("format", ""))
    if refused is not None:
        raise BlobIntegrityError(f"format {metadata['format']!r} is {refused}: refused")
    if set(header) != {"__metadata__", TENSOR}:
        raise BlobIntegrityError(f"blob must hold exactly one tensor named {TENSOR!r}")
    entry = header[TENSOR]
    data_len = len(blob) - 8 - header_len
    if (
        not isinstance(entry, dict)
        or entry.get("dtype") != "U8"
        or entry.get("shape") != [data_len]
        or entry.get("data_offsets") != [0, data_len]
    ):
        raise BlobIntegrityError(f"blob tensor {TENSOR!r} is not 1-D uint8 filling the blob")
    return metadata, raw, memoryview(blob)[8 + header_len :]


def _check(
    namespace: bytes, key: PageKey, metadata: dict[str, str], sealed: memoryview
) -> str | None:
    if set(metadata) != _METADATA_FIELDS:
        return f"metadata fields {sorted(metadata)} are not {sorted(_METADATA_FIELDS)}"
    if metadata["format"] != FORMAT:
        return f"format {metadata['format']!r} is not {FORMAT!r}"
    if metadata["namespace"] != namespace.hex():
        return "it belongs to another namespace"
    if metadata["key"] != key.hex():
        return "it holds another page"
    try:
        nbytes, segment = int(metadata["bytes"]), int(metadata["segment"])
        salt = bytes.fromhex(metadata["salt"])
    except ValueError:
        return "its sizes or salt do not parse"
    if nbytes <= 0 or segment < min(nbytes, 4096) or len(salt) != SALT_BYTES:
        return "its sizes or salt are impossible"
    if len(sealed) != sealed_bytes(nbytes, segment):
        return f"the sealed tensor is not {sealed_bytes(nbytes, segment)} bytes"
    return None
