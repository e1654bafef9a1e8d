"""CUDA prefix keys: bit-identical to the C++ op (itself pinned to the kvci-key-v1 vectors)."""

from __future__ import annotations

import itertools
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


def batch(requests: list[list[int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor(list(itertools.chain.from_iterable(requests)), dtype=dtype)
    offsets = torch.tensor([0, *itertools.accumulate(len(r) for r in requests)], dtype=torch.int64)
    return tokens, offsets


def subkeys_for(n_requests: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    tenants = [f"tenant-{rng.randrange(4)}" for _ in range(n_requests)]
    secret = rng.randbytes(32)
    raw = b"".join(ops.derive_subkeys(b"namespace", tenant, secret) for tenant in tenants)
    return torch.tensor(list(raw), dtype=torch.uint8)


def assert_same_keys(requests: list[list[int]], block_size: int, dtype: torch.dtype, seed: int) -> None:
    tokens, offsets = batch(requests, dtype)
    subkeys = subkeys_for(len(requests), seed)
    cpu_keys, cpu_blocks = kvci_ops.prefix_block_keys_batched(tokens, offsets, block_size, subkeys)
    gpu_keys, gpu_blocks = kvci_ops.prefix_block_keys_batched(tokens.cuda(), offsets, block_size, subkeys)
    assert gpu_keys.device.type == "cuda"
    assert gpu_keys.dtype == torch.uint64
    assert torch.equal(gpu_blocks, cpu_blocks)
    assert torch.equal(gpu_keys.cpu().view(torch.int64), cpu_keys.view(torch.int64))


token_lists = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=300)


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(token_lists, max_size=8),
    block_size=st.integers(1, 40),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**32),
)
def test_batched_keys_match_the_cpu_op(requests: list[list[int]], block_size: int, dtype: torch.dtype,
                                      seed: int) -> None:
    assert_same_keys(requests, block_size, dtype, seed)


@pytest.mark.parametrize("block_size", [1, 15, 16, 32, 33])
def test_a_large_ragged_batch(block_size: int) -> None:
    # Hundreds of requests, one of them long, several empty: every kernel runs many CTAs.
    rng = random.Random(block_size)
    lengths = [rng.choice([0, rng.randrange(1, 9000)]) for _ in range(300)] + [200_000]
    requests = [[rng.randrange(MAX_TOKEN_ID + 1) for _ in range(n)] for n in lengths]
    assert_same_keys(requests, block_size, torch.int64, seed=block_size)


def test_single_request_op_matches_the_cpu_op() -> None:
    rng = random.Random(0)
    tokens = torch.tensor([rng.randrange(MAX_TOKEN_ID + 1) for _ in range(4100)], dtype=torch.int32)
    subkeys = subkeys_for(1, 1)
    expected = kvci_ops.prefix_block_keys(tokens, 16, subkeys)
    for on_gpu in (subkeys, subkeys.cuda()):
        keys = kvci_ops.prefix_block_keys(tokens.cuda(), 16, on_gpu)
        assert torch.equal(keys.cpu().view(torch.int64), expected.view(torch.int64))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_an_id_outside_the_key_format_is_refused(dtype: torch.dtype) -> None:
    # Every id is checked, those of a trailing partial block too; the first bad one is named.
    ids = [5] * 40 + [-7] + [6] * 10 + [-8]
    tokens, offsets = batch([ids[:30], ids[30:]], dtype)
    with pytest.raises(ValueError, match=r"token_ids\[40\] = -7 is outside the token id range"):
        kvci_ops.prefix_block_keys_batched(tokens.cuda(), offsets, 16, subkeys_for(2, 0))
    too_large = torch.tensor([1, 2, 2**31], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"token_ids\[2\] = 2147483648"):
        kvci_ops.prefix_block_keys(too_large.cuda(), 1, subkeys_for(1, 0))


def test_bad_arguments_are_refused() -> None:
    tokens, offsets = batch([[1, 2, 3], [4]], torch.int64)
    subkeys = subkeys_for(2, 0)
    with pytest.raises(ValueError, match="token_offsets must be on the CPU"):
        kvci_ops.prefix_block_keys_batched(tokens.cuda(), offsets.cuda(), 2, subkeys)
    with pytest.raises(ValueError, match=r"subkeys must hold 32 bytes per request \(2 requests\)"):
        kvci_ops.prefix_block_keys_batched(tokens.cuda(), offsets, 2, subkeys[:32])
    with pytest.raises(ValueError, match="token_offsets must start at 0 and end at len"):
        kvci_ops.prefix_block_keys_batched(tokens.cuda(), torch.tensor([0, 3]), 2, subkeys[:32])
    with pytest.raises(ValueError, match="token_ids must be on a CUDA device"):
        kvci_ops.prefix_block_keys(tokens, 2, subkeys[:32].cuda())
    with pytest.raises(ValueError, match="block_size must be positive"):
        kvci_ops.prefix_block_keys(tokens.cuda(), 0, subkeys[:32])
