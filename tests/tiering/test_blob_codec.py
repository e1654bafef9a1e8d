"""The page blob's bytes: read in place, in agreement with safetensors, and refused when the
layout is anything but the one tensor ``encode`` writes."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvci_plugin.tiering.blob_codec import (
    BlobIntegrityError,
    checksum,
    decode,
    encode,
    open_page,
)
from kvci_plugin.tiering.types import PageKey, TenantMismatchError

NS = hashlib.sha256(b"codec-namespace").digest()
KEY = PageKey(hashlib.sha256(b"codec-key").digest()[:16])


def never_quarantined() -> None:
    raise AssertionError("an intact blob was quarantined")


def metadata_of(blob: bytes) -> dict[str, str]:
    header_len = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + header_len])["__metadata__"]


def reencoded(blob: bytes, tensors: dict[str, torch.Tensor]) -> bytes:
    """The blob's metadata (checksum included) around other tensors, written by safetensors."""
    return save_safetensors(tensors, metadata=metadata_of(blob))


def rehashed(page: torch.Tensor, algorithm: str) -> bytes:
    """The blob of ``page`` with its checksum computed by ``algorithm`` instead."""
    metadata = metadata_of(encode(NS, KEY, "a", page))
    metadata["checksum"] = checksum(metadata, page.numpy(), algorithm)
    return save_safetensors({"page": page}, metadata=metadata)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096), tenant=st.sampled_from(["a", "tenant-b"]))
def test_decode_agrees_with_safetensors(data: bytes, tenant: str) -> None:
    page = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    blob = encode(NS, KEY, tenant, page)
    owner, view = decode(blob, NS, KEY)
    assert owner == tenant
    assert bytes(view) == data == load_safetensors(blob)["page"].numpy().tobytes()
    out = torch.empty(len(data), dtype=torch.uint8)
    assert open_page(blob, NS, KEY, tenant, out, never_quarantined) is out
    assert torch.equal(out, page)
    copy = open_page(blob, NS, KEY, tenant, None, never_quarantined)
    assert torch.equal(copy, page) and copy.data_ptr() != out.data_ptr()


def test_the_page_is_copied_out_only_once_it_verified() -> None:
    page = torch.arange(64, dtype=torch.uint8)
    blob = bytearray(encode(NS, KEY, "a", page))
    blob[-1] ^= 1
    out = torch.full((64,), 7, dtype=torch.uint8)
    quarantined = []
    with pytest.raises(BlobIntegrityError, match="checksum mismatch; quarantined"):
        open_page(bytes(blob), NS, KEY, "a", out, lambda: quarantined.append(1))
    assert quarantined == [1]
    assert bool((out == 7).all())


def test_another_tenant_is_refused_without_quarantine() -> None:
    blob = encode(NS, KEY, "a", torch.ones(8, dtype=torch.uint8))
    with pytest.raises(TenantMismatchError):
        open_page(blob, NS, KEY, "b", None, never_quarantined)


@pytest.mark.parametrize(
    ("tensors", "problem"),
    [
        ({"page": torch.ones(8, dtype=torch.uint8), "extra": torch.ones(1, dtype=torch.uint8)},
         "exactly one tensor"),
        ({"other": torch.ones(8, dtype=torch.uint8)}, "exactly one tensor"),
        ({"page": torch.ones(4, dtype=torch.int16)}, "not 1-D uint8"),
        ({"page": torch.ones((2, 4), dtype=torch.uint8)}, "not 1-D uint8"),
    ],
    ids=["extra tensor", "renamed tensor", "int16", "2-D"],
)
def test_any_other_layout_is_refused(tensors: dict[str, torch.Tensor], problem: str) -> None:
    blob = reencoded(encode(NS, KEY, "a", torch.ones(8, dtype=torch.uint8)), tensors)
    with pytest.raises(BlobIntegrityError, match=problem):
        decode(blob, NS, KEY)


def test_bytes_after_the_tensor_are_refused() -> None:
    blob = encode(NS, KEY, "a", torch.ones(8, dtype=torch.uint8))
    with pytest.raises(BlobIntegrityError, match="not 1-D uint8 filling the blob"):
        decode(blob + b"\0", NS, KEY)


@pytest.mark.parametrize("header", [b"[]", b"{", b'{"page": 1, "__metadata__": {}}',
                                    b'{"page": {}, "__metadata__": {"bytes": 8}}'])
def test_a_malformed_header_is_refused(header: bytes) -> None:
    blob = len(header).to_bytes(8, "little") + header + b"\0" * 8
    with pytest.raises(BlobIntegrityError):
        decode(blob, NS, KEY)


def test_blobs_checksummed_with_sha256_still_verify() -> None:
    page = torch.arange(200, dtype=torch.uint8)
    assert metadata_of(encode(NS, KEY, "a", page))["checksum"].startswith("xxh3-128:")
    blob = rehashed(page, "sha256")
    assert metadata_of(blob)["checksum"].startswith("sha256:")
    assert bytes(decode(blob, NS, KEY)[1]) == bytes(page.numpy())
    flipped = bytearray(blob)
    flipped[-7] ^= 0x10
    with pytest.raises(BlobIntegrityError, match="checksum mismatch"):
        decode(bytes(flipped), NS, KEY)


def test_a_checksum_of_an_unknown_algorithm_is_refused() -> None:
    blob = encode(NS, KEY, "a", torch.ones(8, dtype=torch.uint8))
    metadata = metadata_of(blob)
    metadata["checksum"] = "md5:" + metadata["checksum"].partition(":")[2]
    forged = save_safetensors({"page": torch.ones(8, dtype=torch.uint8)}, metadata=metadata)
    with pytest.raises(BlobIntegrityError, match="checksum algorithm 'md5' is not one of"):
        decode(forged, NS, KEY)
