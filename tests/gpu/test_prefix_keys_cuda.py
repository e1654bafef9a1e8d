"""CUDA prefix keys: bit-identical to the C++ op (itself pinned to the kvci-key-v1 vectors)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin import ops
from kvci_plugin.ops._native import kvci_ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKEN_ID = 2**31 - 1


def subkeys_for(n_requests: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    tenants = [f"tenant-{rng.randrange(4)}" for _ in range(n_requests)]
    secret = rng.randbytes(32)
    raw = b"".join(ops.derive_subkeys(b"namespace", tenant, secret) for tenant in tenants)
    return torch.tensor(list(raw), dtype=torch.uint8)


def as_int64(keys: torch.Tensor) -> torch.Tensor:
    return keys.cpu().view(torch.int64)


def assert_same_keys(requests: list[torch.Tensor], block_size: int, seed: int) -> None:
    subkeys = subkeys_for(len(requests), seed)
    expected = kvci_ops.prefix_block_keys_batched(requests, block_size, subkeys)
    keys = kvci_ops.prefix_block_keys_batched([r.cuda() for r in requests], block_size, subkeys)
    assert len(keys) == len(expected)
    for got, want in zip(keys, expected, strict=True):
        assert got.device.type == "cuda"
        assert got.dtype == torch.uint64
        assert torch.equal(as_int64(got), as_int64(want))


requests_ = st.lists(
    st.tuples(
        st.lists(st.integers(0, MAX_TOKEN_ID), max_size=300),
        st.sampled_from([torch.int32, torch.int64]),
    ),
    max_size=8,
)


@settings(max_examples=80, deadline=None)
@given(requests=requests_, block_size=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_batched_keys_match_the_cpu_op(
    requests: list[tuple[list[int], torch.dtype]], block_size: int, seed: int
) -> None:
    # Mixed int32 and int64 requests, empty ones and partial blocks included.
    assert_same_keys([torch.tensor(ids, dtype=dtype) for ids, dtype in requests], block_size, seed)


@pytest.mark.parametrize("block_size", [1, 15, 16, 32, 33])
def test_a_large_ragged_batch(block_size: int) -> None:
    # Hundreds of requests, one of them long, about half empty: every kernel runs many CTAs.
    generator = torch.Generator().manual_seed(block_size)
    lengths = torch.randint(1, 9000, (301,), generator=generator) * torch.randint(
        0, 2, (301,), generator=generator
    )
    lengths[-1] = 200_000
    tokens = torch.randint(0, MAX_TOKEN_ID + 1, (int(lengths.sum()),), generator=generator)
    assert_same_keys(list(tokens.split(lengths.tolist())), block_size, block_size)


def test_single_request_op_matches_the_cpu_op() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MAX_TOKEN_ID + 1, (4100,), generator=generator, dtype=torch.int32)
    subkeys = subkeys_for(1, 1)
    expected = kvci_ops.prefix_block_keys(tokens, 16, subkeys)
    for on_either in (subkeys, subkeys.cuda()):
        keys = kvci_ops.prefix_block_keys(tokens.cuda(), 16, on_either)
        assert keys.device.type == "cuda"
        assert torch.equal(as_int64(keys), as_int64(expected))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_an_id_outside_the_key_format_is_refused(dtype: torch.dtype) -> None:
    # Every id is checked, those of a trailing partial block too; the first bad one is named.
    first = torch.full((30,), 5, dtype=dtype)
    second = torch.tensor([6] * 10 + [-7] + [6] * 8 + [-8], dtype=dtype)
    with pytest.raises(
        ValueError, match=r"token_ids\[1\]\[10\] = -7 is outside the token id range"
    ):
        kvci_ops.prefix_block_keys_batched([first.cuda(), second.cuda()], 16, subkeys_for(2, 0))
    too_large = torch.tensor([1, 2, 2**31], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"token_ids\[2\] = 2147483648"):
        kvci_ops.prefix_block_keys(too_large.cuda(), 1, subkeys_for(1, 0))


def test_bad_arguments_are_refused() -> None:
    tokens = torch.tensor([1, 2, 3])
    one, two = subkeys_for(1, 0), subkeys_for(2, 0)
    with pytest.raises(ValueError, match=r"token_ids\[1\] must be on cuda:0, got device cpu"):
        kvci_ops.prefix_block_keys_batched([tokens.cuda(), tokens], 2, two)
    with pytest.raises(
        ValueError, match=r"token_ids\[0\] must be on a CUDA device when another argument is"
    ):
        kvci_ops.prefix_block_keys_batched([tokens, tokens.cuda()], 2, two)
    with pytest.raises(ValueError, match=r"subkeys must hold 32 bytes per request \(2 requests\)"):
        kvci_ops.prefix_block_keys_batched([tokens.cuda(), tokens.cuda()], 2, one)
    with pytest.raises(
        ValueError, match="token_ids must be on a CUDA device when another argument is"
    ):
        kvci_ops.prefix_block_keys(tokens, 2, one.cuda())
    with pytest.raises(TypeError, match="token_ids must be int32 or int64"):
        kvci_ops.prefix_block_keys(tokens.cuda().float(), 2, one)
    with pytest.raises(ValueError, match="block_size must be positive"):
        kvci_ops.prefix_block_keys(tokens.cuda(), 0, one)
    assert (
        kvci_ops.prefix_block_keys_batched([], 2, torch.empty(0, dtype=torch.uint8, device="cuda"))
        == []
    )
