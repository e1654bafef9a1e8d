"""The RAM tier's pool on a CUDA machine: page-locked at its exact size (not through torch's
pinned allocator, which rounds up to a power of two), and usable by the CUDA page copies."""

from __future__ import annotations

import gc

import pytest
import torch

from kvci_plugin.tiering.ram.pool import PagePool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOT = 1 << 20


def test_the_pool_is_page_locked_outside_torchs_rounding_allocator() -> None:
    torch.cuda.init()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    pool = PagePool(33, SLOT)  # 33 MiB: torch's allocator would lock 64
    assert pool.pinned and pool._pool.is_pinned()
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before
    buffer = pool._pool
    del pool
    gc.collect()
    assert not buffer.is_pinned()  # unlocked with its pool


def test_the_cuda_copies_read_and_write_the_locked_pool() -> None:
    generator = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (8, SLOT), dtype=torch.uint8, generator=generator).cuda()
    pool = PagePool(4, SLOT)
    pool.store([cache], [6, 1], [3, 0])
    torch.cuda.synchronize()
    assert torch.equal(pool.read(3), cache[6].cpu())
    assert torch.equal(pool.read(0), cache[1].cpu())
    pool.load([3], [cache], [2])
    torch.cuda.synchronize()
    assert torch.equal(cache[2], cache[6])
