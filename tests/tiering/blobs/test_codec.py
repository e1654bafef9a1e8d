"""The sealed page blob: read in place, in agreement with safetensors, and refused when it is
forged, moved, reordered, truncated, bit-flipped, of the old checksum-only format or of any other
layout."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvci_plugin.tiering.blobs.codec import SEGMENT_BYTES, TAG_BYTES, encode, open_page
from kvci_plugin.tiering.blobs.errors import BlobIntegrityError
from kvci_plugin.tiering.blobs.tenant_keys import (
    MemoryMaterials,
    TenantKeys,
    TenantKeyUnavailableError,
)
from kvci_plugin.tiering.types import PageKey, TenantMismatchError

NS = hashlib.sha256(b"codec-namespace").digest()
OTHER_NS = hashlib.sha256(b"codec-other-namespace").digest()
KEY = PageKey(hashlib.sha256(b"codec-key").digest()[:16])
ROOT = hashlib.sha256(b"codec-root-key").digest()


KEYS = TenantKeys(ROOT, MemoryMaterials())


def sealed(page: torch.Tensor, tenant: str = "a", keys: TenantKeys = KEYS,
           namespace: bytes = NS, key: PageKey = KEY) -> bytes:
    return bytes(encode(keys.for_write(tenant, namespace), namespace, key, page))


def never_quarantined() -> None:
    raise AssertionError("an intact blob was quarantined")


def metadata_of(blob: bytes) -> dict[str, str]:
    header_len = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + header_len])["__metadata__"]


def opened(blob: bytes, tenant: str = "a", keys: TenantKeys = KEYS, out: torch.Tensor | None = None,
           quarantine=never_quarantined) -> torch.Tensor:
    return open_page(blob, keys, tenant, NS, KEY, out, quarantine)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096), tenant=st.sampled_from(["a", "tenant-b"]))
def test_a_sealed_blob_is_safetensors_and_opens_for_its_tenant(data: bytes, tenant: str) -> None:
    page = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    blob = sealed(page, tenant)
    stored = load_safetensors(blob)["sealed"].numpy().tobytes()
    assert len(stored) == len(data) + TAG_BYTES
    assert len(data) < 8 or data not in stored  # (a short run may occur by chance)
    out = torch.empty(len(data), dtype=torch.uint8)
    assert opened(blob, tenant, out=out) is out
    assert torch.equal(out, page)
    assert torch.equal(opened(blob, tenant), page)


def test_the_metadata_names_no_tenant_and_no_key() -> None:
    blob = sealed(torch.ones(64, dtype=torch.uint8), "acme-corp")
    meta = metadata_of(blob)
    assert meta["tenant"] == KEYS.tenant_id("acme-corp") != "acme-corp"
    assert b"acme-corp" not in blob
    assert KEYS.for_read("acme-corp", NS).key not in blob
    assert "key=" not in repr(KEYS.for_read("acme-corp", NS)) and ROOT.hex() not in repr(KEYS)


def test_every_single_bit_flip_is_refused() -> None:
    """Exhaustive on a small blob: no flipped bit anywhere (header, metadata, sealed bytes, tag)
    loads, and none leaves unauthenticated bytes in ``out``."""
    page = torch.arange(48, dtype=torch.uint8)
    blob = sealed(page)
    for bit in range(8 * len(blob)):
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        out = torch.full((48,), 7, dtype=torch.uint8)
        with pytest.raises((BlobIntegrityError, TenantMismatchError)):
            opened(bytes(damaged), out=out, quarantine=lambda: None)
        assert bool((out == 7).all()) or bool((out == 0).all()), f"bit {bit}"


def test_a_forged_blob_is_refused_and_quarantined() -> None:
    """A writer with the store but not the root key: their own keys, the victim's tenant id."""
    forger = TenantKeys(os.urandom(32), MemoryMaterials())
    forged = bytearray(sealed(torch.zeros(64, dtype=torch.uint8), "a", keys=forger))
    victim_meta = metadata_of(sealed(torch.zeros(64, dtype=torch.uint8)))
    header_len = int.from_bytes(forged[:8], "little")
    header = json.loads(forged[8 : 8 + header_len])
    header["__metadata__"]["tenant"] = victim_meta["tenant"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (header_len - len(text))
    forged[8 : 8 + header_len] = text
    quarantined = []
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        opened(bytes(forged), quarantine=lambda: quarantined.append(1))
    assert quarantined == [1]


def test_another_tenant_is_refused_without_quarantine() -> None:
    blob = sealed(torch.ones(8, dtype=torch.uint8), "a")
    with pytest.raises(TenantMismatchError) as refused:
        opened(blob, "b")
    assert "a" not in str(refused.value).split()


def test_a_blob_of_another_namespace_or_page_is_refused() -> None:
    moved = sealed(torch.ones(8, dtype=torch.uint8), namespace=OTHER_NS)
    with pytest.raises(BlobIntegrityError, match="another namespace"):
        opened(moved, quarantine=lambda: None)
    other_page = sealed(torch.ones(8, dtype=torch.uint8), key=PageKey(b"\1" * 16))
    with pytest.raises(BlobIntegrityError, match="another page"):
        opened(other_page, quarantine=lambda: None)


def test_segments_reordered_or_dropped_are_refused() -> None:
    """Three segments: swapping two, or cutting the last (with the length fields made to agree),
    fails authentication: each segment's associated data names its index and the count."""
    page = torch.randint(0, 256, (2 * SEGMENT_BYTES + 100,), dtype=torch.uint8)
    blob = sealed(page)
    assert torch.equal(opened(blob), page)
    header_len = int.from_bytes(blob[:8], "little")
    head, body = blob[: 8 + header_len], blob[8 + header_len :]
    step = SEGMENT_BYTES + TAG_BYTES
    swapped = head + body[step : 2 * step] + body[:step] + body[2 * step :]
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        opened(swapped, quarantine=lambda: None)
    header = json.loads(head[8:])
    header["__metadata__"]["bytes"] = str(2 * SEGMENT_BYTES)
    header["sealed"]["shape"] = [2 * step]
    header["sealed"]["data_offsets"] = [0, 2 * step]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    cut = len(text).to_bytes(8, "little") + text + body[: 2 * step]
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        opened(cut, quarantine=lambda: None)


def test_a_forgotten_tenant_has_no_key_and_its_blob_is_not_quarantined() -> None:
    keys = TenantKeys(ROOT, MemoryMaterials())
    blob = sealed(torch.ones(8, dtype=torch.uint8), "gone", keys=keys)
    assert keys.forget("gone") and not keys.forget("gone")
    with pytest.raises(TenantKeyUnavailableError):
        opened(blob, "gone", keys=keys)
    with pytest.raises(TenantKeyUnavailableError, match="forgotten"):
        keys.for_write("gone", NS)  # a write under way at the forget makes no material
    keys.ensure("gone")  # a write registered after it does: fresh, and the old blob stays shut
    with pytest.raises(BlobIntegrityError, match="authentication failed"):
        opened(blob, "gone", keys=keys, quarantine=lambda: None)


def test_checksum_only_blobs_of_the_first_format_are_refused_by_name() -> None:
    page = torch.ones(8, dtype=torch.uint8)
    old = save_safetensors({"page": page}, metadata={
        "format": "kvci.page.v1", "namespace": NS.hex(), "key": KEY.hex(), "tenant": "a",
        "bytes": "8", "created": "0", "checksum": "xxh3-128:0"})
    quarantined = []
    with pytest.raises(BlobIntegrityError, match="'kvci.page.v1' is a checksum-only blob"):
        opened(old, quarantine=lambda: quarantined.append(1))
    assert quarantined == [1]


@pytest.mark.parametrize(
    ("tensors", "problem"),
    [
        ({"sealed": torch.ones(24, dtype=torch.uint8), "extra": torch.ones(1, dtype=torch.uint8)},
         "exactly one tensor"),
        ({"other": torch.ones(24, dtype=torch.uint8)}, "exactly one tensor"),
        ({"sealed": torch.ones(12, dtype=torch.int16)}, "not 1-D uint8"),
        ({"sealed": torch.ones((2, 12), dtype=torch.uint8)}, "not 1-D uint8"),
    ],
    ids=["extra tensor", "renamed tensor", "int16", "2-D"],
)
def test_any_other_layout_is_refused(tensors: dict[str, torch.Tensor], problem: str) -> None:
    blob = save_safetensors(tensors, metadata=metadata_of(sealed(torch.ones(8, dtype=torch.uint8))))
    with pytest.raises(BlobIntegrityError, match=problem):
        opened(blob, quarantine=lambda: None)


def test_bytes_after_the_tensor_are_refused() -> None:
    blob = sealed(torch.ones(8, dtype=torch.uint8))
    with pytest.raises(BlobIntegrityError, match="not 1-D uint8 filling the blob"):
        opened(blob + b"\0", quarantine=lambda: None)


@pytest.mark.parametrize("header", [b"[]", b"{", b'{"sealed": 1, "__metadata__": {}}',
                                    b'{"sealed": {}, "__metadata__": {"bytes": 8}}'])
def test_a_malformed_header_is_refused(header: bytes) -> None:
    blob = len(header).to_bytes(8, "little") + header + b"\0" * 8
    with pytest.raises(BlobIntegrityError):
        opened(blob, quarantine=lambda: None)
