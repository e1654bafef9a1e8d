"""Helpers of the worker tests, which import no vllm and run with the KV cache on the CPU here
and on a GPU on the device machine (benchmarks/gpu/run.sh runs them there)."""

from __future__ import annotations

import hashlib

import pytest
import torch

KV_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")]),
]
"""Parametrize a test's ``device`` with these: the worker must pick the CUDA ops by itself."""

NUM_BLOCKS = 16
# Two layers, blocks outermost: (blocks, 2, block_size, heads, head_size) float32 = 8 KiB a page.
LAYER_SHAPE = (NUM_BLOCKS, 2, 32, 4, 8)
SLOT = 2 * 2 * 32 * 4 * 8 * 4


def page_of(i: int) -> torch.Tensor:
    """Slot ``i``'s bytes in these tests: a page of every layer, distinct for each ``i``."""
    return torch.frombuffer(bytearray(hashlib.shake_128(f"page-{i}".encode()).digest(SLOT)),
                            dtype=torch.uint8)


def kv_cache(device: str) -> dict[str, torch.Tensor]:
    return {f"layer.{n}": torch.zeros(LAYER_SHAPE, device=device) for n in range(2)}


def block_bytes(kv: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """What a pool slot holds for ``block``: its page of every layer, on the host."""
    return torch.cat([t[block].contiguous().view(torch.uint8).flatten().cpu() for t in kv.values()])


def write_block(kv: dict[str, torch.Tensor], block: int, page: torch.Tensor) -> None:
    """Put ``page`` (a slot's bytes) into ``block`` of every layer, as a forward would. A page
    already on the cache's GPU is queued like a forward's writes; one from the host blocks."""
    offset = 0
    for t in kv.values():
        n = t[block].numel() * t.element_size()
        t[block].view(torch.uint8).view(-1).copy_(page[offset : offset + n])
        offset += n
