"""Page views over the KV cache views vLLM itself builds, for every KV cache layout it knows:
each row is exactly one block's bytes of one layer, as they lie in the backing buffer; a layout
that scatters a block across memory is refused with the way out named."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvci_plugin.connector.pages import page_views, slot_bytes
from kvci_plugin.tiering.ram.pool import PagePool

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
NUM_BLOCKS = 6
LAYERS = [f"model.layers.{i}.attn" for i in range(3)]
DENSE = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC]
SCATTERED = [KVCacheLayout.LHBNC, KVCacheLayout.BHLNC]


def vllm_views(layout: KVCacheLayout, kernel_block_size: int | None = None
               ) -> tuple[torch.Tensor, KVCacheTensor, dict[str, torch.Tensor]]:
    """A random backing buffer and the per-layer views vLLM's worker makes of it."""
    strides = compute_layout_strides(SPEC, NUM_BLOCKS, len(LAYERS), layout)
    size = SPEC.page_size_bytes * NUM_BLOCKS * len(LAYERS)
    raw = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    tensor = KVCacheTensor(
        size=size, layers=LAYERS, layer_stride=strides[0], block_stride=strides[1]
    )
    views = create_kv_cache_views(raw.view(torch.int8), SPEC, NUM_BLOCKS, layout, tensor,
                                  kernel_block_size=kernel_block_size)
    return raw, tensor, dict(zip(LAYERS, views, strict=True))


def expected_page(raw: torch.Tensor, tensor: KVCacheTensor, layer: int, block: int) -> torch.Tensor:
    start = layer * tensor.layer_stride + block * tensor.block_stride
    return raw[start : start + SPEC.page_size_bytes]


@pytest.mark.parametrize("layout", DENSE, ids=lambda layout: layout.name)
def test_each_row_is_one_block_of_one_layer_in_memory_order(layout: KVCacheLayout) -> None:
    raw, tensor, kv = vllm_views(layout)
    pages = page_views(kv, NUM_BLOCKS)
    assert slot_bytes(pages) == SPEC.page_size_bytes * len(LAYERS)
    for layer, view in enumerate(pages):
        assert view.data_ptr() >= raw.data_ptr()  # a view of the cache, never a copy
        for block in range(NUM_BLOCKS):
            assert torch.equal(view[block], expected_page(raw, tensor, layer, block))


def test_kernel_blocks_are_grouped_back_into_blocks() -> None:
    raw, tensor, kv = vllm_views(KVCacheLayout.LBNHC, kernel_block_size=8)
    assert next(iter(kv.values())).shape[0] == 2 * NUM_BLOCKS
    pages = page_views(kv, NUM_BLOCKS)
    for layer, view in enumerate(pages):
        for block in range(NUM_BLOCKS):
            assert torch.equal(view[block], expected_page(raw, tensor, layer, block))


def test_a_store_and_load_round_trip_through_a_permuted_layout() -> None:
    raw, tensor, kv = vllm_views(KVCacheLayout.LBNHC)
    pages = page_views(kv, NUM_BLOCKS)
    pool = PagePool(4, slot_bytes(pages), pin_memory=False)
    pool.store(pages, [4, 1], [0, 3])
    before = raw.clone()
    pool.load([0, 3], pages, [2, 5])
    for layer in range(len(LAYERS)):
        assert torch.equal(
            expected_page(raw, tensor, layer, 2), expected_page(before, tensor, layer, 4)
        )
        assert torch.equal(
            expected_page(raw, tensor, layer, 5), expected_page(before, tensor, layer, 1)
        )
    untouched = [b for b in range(NUM_BLOCKS) if b not in (2, 5)]
    for layer in range(len(LAYERS)):
        for block in untouched:
            assert torch.equal(expected_page(raw, tensor, layer, block),
                               expected_page(before, tensor, layer, block))


@pytest.mark.parametrize("layout", SCATTERED, ids=lambda layout: layout.name)
def test_a_layout_that_scatters_a_block_is_refused(layout: KVCacheLayout) -> None:
    _, _, kv = vllm_views(layout)
    with pytest.raises(ValueError, match="not dense in memory.*VLLM_KV_CACHE_LAYOUT=LBNHC"):
        page_views(kv, NUM_BLOCKS)
