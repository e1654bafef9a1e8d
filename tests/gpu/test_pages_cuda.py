"""CUDA page copies: exact bytes against torch indexing, for vLLM's CUDA layouts and KV dtypes.

The public ``kvci_plugin.ops`` functions are called with the KV cache on the GPU and the pool in
pinned host memory: the dispatcher must pick the CUDA kernels by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

KV_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def random_bytes(
    shape: tuple[int, ...], generator: torch.Generator, device: str = "cuda"
) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(device)


def page_view(per_block: torch.Tensor) -> torch.Tensor:
    """The int8 page view (num_blocks, page_bytes) of a tensor whose dim 0 is the block."""
    return per_block.view(torch.uint8).view(per_block.shape[0], -1)


@dataclass(frozen=True)
class Layout:
    """One of vLLM's CUDA KV cache layouts: how a layer's cache tensor is shaped and viewed."""

    name: str
    make: Callable[[int, int, int, int, torch.dtype, torch.Generator], torch.Tensor]
    views: Callable[[torch.Tensor], list[torch.Tensor]]
    block_dim: int  # the block dimension of the cache tensor


def _cache(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = random_bytes((*shape[:-1], shape[-1] * itemsize), generator)
    return raw.view(dtype)


LAYOUTS = [
    # FlashAttention, NHD: (2, num_blocks, block_size, heads, head_size); K and V pages apart.
    Layout(
        "flash_attn_nhd",
        lambda nb, bs, h, d, dt, g: _cache((2, nb, bs, h, d), dt, g),
        lambda cache: [page_view(cache[0]), page_view(cache[1])],
        block_dim=1,
    ),
    # FlashAttention with the HND stride order: the same logical shape over (2, nb, h, bs, d)
    # memory; the views are taken from the memory order.
    Layout(
        "flash_attn_hnd",
        lambda nb, bs, h, d, dt, g: _cache((2, nb, h, bs, d), dt, g).permute(0, 1, 3, 2, 4),
        lambda cache: [
            page_view(cache[0].permute(0, 2, 1, 3)),
            page_view(cache[1].permute(0, 2, 1, 3)),
        ],
        block_dim=1,
    ),
    # FlashInfer, HND: (num_blocks, 2, heads, block_size, head_size); one dense page per block.
    Layout(
        "flashinfer_hnd",
        lambda nb, bs, h, d, dt, g: _cache((nb, 2, h, bs, d), dt, g),
        lambda cache: [page_view(cache)],
        block_dim=0,
    ),
    # MLA: (num_blocks, block_size, kv_lora_rank + rope_dim), a single head.
    Layout(
        "mla",
        lambda nb, bs, h, d, dt, g: _cache((nb, bs, 512 + 64), dt, g),
        lambda cache: [page_view(cache)],
        block_dim=0,
    ),
]

NUM_BLOCKS = 48
NUM_LAYERS = 3


def build_caches(
    layout: Layout, dtype: torch.dtype, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    caches = [layout.make(NUM_BLOCKS, 16, 2, 64, dtype, generator) for _ in range(NUM_LAYERS)]
    return caches, [view for cache in caches for view in layout.views(cache)]


def pinned_pool(num_slots: int, slot_bytes: int, generator: torch.Generator) -> torch.Tensor:
    pool = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=True)
    pool.copy_(random_bytes((num_slots, slot_bytes), generator, "cpu"))
    return pool


def expected_gather(views: list[torch.Tensor], blocks: torch.Tensor, pool: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    expected = pool.clone()
    expected[slots, : ops.pool_slot_bytes(views)] = torch.cat(
        [v[blocks.cuda()].view(torch.uint8) for v in views], 1
    ).cpu()
    return expected


def cache_bytes(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [cache.view(torch.uint8).clone() for cache in caches]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_gather_matches_torch_indexing(layout: Layout, dtype: torch.dtype) -> None:
    caches, views = build_caches(layout, dtype, seed=1)
    generator = torch.Generator().manual_seed(2)
    pool = pinned_pool(40, ops.pool_slot_bytes(views) + 32, generator)
    blocks = torch.randint(0, NUM_BLOCKS, (25,), generator=generator)
    slots = torch.randperm(40, generator=generator)[:25]
    expected = expected_gather(views, blocks, pool, slots)
    before = cache_bytes(caches)
    ops.gather_pages(views, blocks, pool, slots)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, caches, strict=True))


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_scatter_matches_torch_indexing(layout: Layout, dtype: torch.dtype) -> None:
    caches, views = build_caches(layout, dtype, seed=3)
    generator = torch.Generator().manual_seed(4)
    pool = pinned_pool(30, ops.pool_slot_bytes(views), generator)
    blocks = torch.randperm(NUM_BLOCKS, generator=generator)[:20]
    slots = torch.randint(0, 30, (20,), generator=generator)
    expected_caches, expected_views = build_caches(layout, dtype, seed=3)
    at = 0
    for view in expected_views:
        view[blocks.cuda()] = pool[slots, at : at + view.shape[1]].cuda()
        at += view.shape[1]
    pool_before = pool.clone()
    ops.scatter_pages(pool, slots, views, blocks)
    torch.cuda.synchronize()
    assert all(
        torch.equal(a, b)
        for a, b in zip(cache_bytes(caches), cache_bytes(expected_caches), strict=True)
    )
    assert torch.equal(pool, pool_before)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_round_trip_moves_kv_between_blocks(layout: Layout) -> None:
    # What a load after a save does: the KV of blocks `source` reappears in blocks `target`,
    # seen through the cache tensors the attention backend reads.
    caches, views = build_caches(layout, torch.bfloat16, seed=5)
    generator = torch.Generator().manual_seed(6)
    order = torch.randperm(NUM_BLOCKS, generator=generator)
    source, target = order[:16], order[16:32]
    pool = pinned_pool(16, ops.pool_slot_bytes(views), generator)
    slots = torch.randperm(16, generator=generator)
    ops.gather_pages(views, source, pool, slots)
    ops.scatter_pages(pool, slots, views, target)
    torch.cuda.synchronize()
    for cache in caches:
        raw = cache.view(torch.uint8)
        assert torch.equal(raw.index_select(layout.block_dim, target.cuda()),
                           raw.index_select(layout.block_dim, source.cuda()))


byte_layers = st.lists(
    st.tuples(
        st.integers(1, 40000), st.integers(0, 40), st.sampled_from([torch.uint8, torch.int8])
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    pages=byte_layers,
    num_blocks=st.integers(1, 40),
    num_slots=st.integers(1, 40),
    pool_shift=st.integers(0, 17),
    data=st.data(),
)
def test_any_page_sizes_and_alignments(seed: int, pages: list, num_blocks: int, num_slots: int,
                                       pool_shift: int, data: st.DataObject) -> None:
    # Odd sizes, row padding and a pool that starts off any 16-byte boundary take the narrower
    # copy widths; pages above 16 KiB span several chunks.
    generator = torch.Generator().manual_seed(seed)
    wholes = [random_bytes((num_blocks, size + pad), generator) for size, pad, _ in pages]
    views = [
        whole.view(dtype)[:, :size] for whole, (size, _, dtype) in zip(wholes, pages, strict=True)
    ]
    slot_bytes = ops.pool_slot_bytes(views)
    backing = pinned_pool(num_slots, slot_bytes + pool_shift, generator)
    pool = backing[:, pool_shift:]
    n = data.draw(st.integers(0, min(num_slots, num_blocks)))
    slots = torch.tensor(data.draw(st.permutations(range(num_slots)))[:n], dtype=torch.long)
    blocks = torch.tensor(data.draw(st.permutations(range(num_blocks)))[:n], dtype=torch.long)
    expected_pool = expected_gather(views, blocks, pool, slots)
    ops.gather_pages(views, blocks, pool, slots)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected_pool)
    # Back into other blocks: a fresh copy of every layer, rolled by one block.
    moved = (blocks + 1) % num_blocks
    expected_wholes = [whole.clone() for whole in wholes]
    at = 0
    for whole, view in zip(expected_wholes, views, strict=True):
        width = view.shape[1]
        whole[moved.cuda(), :width] = pool[slots, at : at + width].cuda()
        at += width
    ops.scatter_pages(pool, slots, views, moved)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(wholes, expected_wholes, strict=True))


def test_the_op_takes_a_pool_on_the_gpu() -> None:
    # The native op also copies into device memory (kvci_plugin.ops keeps the pool on the host).
    _, views = build_caches(LAYOUTS[0], torch.float16, seed=7)
    generator = torch.Generator().manual_seed(8)
    pool = random_bytes((10, ops.pool_slot_bytes(views)), generator)
    blocks, slots = torch.tensor([5, 0, 47]), torch.tensor([9, 3, 4])
    expected = expected_gather(views, blocks, pool.cpu(), slots)
    kvci_ops.gather_pages(views, blocks, pool, slots)
    assert torch.equal(pool.cpu(), expected)


def test_a_llama_sized_batch() -> None:
    # 32-token bf16 pages of 8 heads x 128: 64 KiB per K or V page, four chunks each.
    generator = torch.Generator().manual_seed(9)
    caches = [_cache((2, 300, 32, 8, 128), torch.bfloat16, generator) for _ in range(4)]
    views = [page_view(c[kv]) for c in caches for kv in (0, 1)]
    pool = pinned_pool(200, ops.pool_slot_bytes(views), generator)
    blocks = torch.randperm(300, generator=generator)[:200]
    slots = torch.randperm(200, generator=generator)
    expected = expected_gather(views, blocks, pool, slots)
    ops.gather_pages(views, blocks, pool, slots)
    restored = [torch.zeros_like(v) for v in views]
    ops.scatter_pages(pool, slots, restored, blocks)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected)
    for view, copy in zip(views, restored, strict=True):
        assert torch.equal(copy[blocks.cuda()], view[blocks.cuda()])


def test_copies_are_queued_on_the_current_stream() -> None:
    # The worker runs loads and saves on a side stream beside the forward pass: the op must
    # enqueue there and return without waiting for the GPU.
    _, views = build_caches(LAYOUTS[2], torch.bfloat16, seed=10)
    generator = torch.Generator().manual_seed(11)
    pool = pinned_pool(8, ops.pool_slot_bytes(views), generator)
    blocks, slots = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 7])
    expected = expected_gather(views, blocks, pool, slots)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ops.gather_pages(views, blocks, pool, slots)  # warm: first pinned and device allocations
        side.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time on this stream
        ops.gather_pages(views, blocks, pool, slots)
        done = torch.cuda.Event()
        done.record(side)
    returned_early = not done.query()
    default_stream_idle = torch.cuda.default_stream().query()
    done.synchronize()
    assert returned_early
    assert default_stream_idle
    assert torch.equal(pool, expected)


def small_setup() -> tuple[list[torch.Tensor], torch.Tensor]:
    layers = [
        torch.zeros(4, 8, dtype=torch.uint8, device="cuda"),
        torch.zeros(4, 4, dtype=torch.int8, device="cuda"),
    ]
    return layers, torch.zeros(3, 12, dtype=torch.uint8, pin_memory=True)


# Changes are built lazily: collecting this module must not touch CUDA on a machine without it.
BAD_INPUTS = [
    (
        lambda: {"block_ids": torch.tensor([4])},
        IndexError,
        r"block_ids\[0\] = 4 is out of range for layers with num_blocks 4",
    ),
    (
        lambda: {"slot_ids": torch.tensor([3])},
        IndexError,
        r"slot_ids\[0\] = 3 is out of range for pool with num_slots 3",
    ),
    (
        lambda: {"block_ids": torch.tensor([0, 1]), "slot_ids": torch.tensor([0])},
        ValueError,
        "differ in length",
    ),
    (
        lambda: {"block_ids": torch.tensor([1], device="cuda")},
        ValueError,
        "block_ids must be on the CPU",
    ),
    (
        lambda: {"pool": torch.zeros(3, 12, dtype=torch.uint8)},
        ValueError,
        "pool is in pageable host memory",
    ),
    (
        lambda: {"pool": torch.zeros(3, 11, dtype=torch.uint8, pin_memory=True)},
        ValueError,
        "pool slots hold 11 bytes",
    ),
    (
        lambda: {
            "layers": [torch.zeros(4, 8, dtype=torch.uint8)],
            "block_ids": torch.tensor([1], device="cuda"),
        },
        ValueError,
        "layers must be on a CUDA device",
    ),
    (
        lambda: {"layers": [torch.zeros(4, 8, device="cuda")]},
        TypeError,
        r"layers\[0\] must be uint8 or int8",
    ),
    (
        lambda: {"layers": [torch.zeros(8, 4, dtype=torch.uint8, device="cuda").t()]},
        ValueError,
        r"layers\[0\] rows must be dense",
    ),
]


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize(
    ("change", "error", "match"), BAD_INPUTS, ids=[match for _, _, match in BAD_INPUTS]
)
def test_bad_input_is_refused(
    direction: str, change: Callable[[], dict], error: type, match: str
) -> None:
    layers, pool = small_setup()
    args = {
        "layers": layers,
        "block_ids": torch.tensor([1]),
        "pool": pool,
        "slot_ids": torch.tensor([2]),
        **change(),
    }
    with pytest.raises(error, match=match):
        if direction == "gather":
            ops.gather_pages(args["layers"], args["block_ids"], args["pool"], args["slot_ids"])
        else:
            ops.scatter_pages(args["pool"], args["slot_ids"], args["layers"], args["block_ids"])


def test_a_destination_is_written_once() -> None:
    layers, pool = small_setup()
    with pytest.raises(ValueError, match="slot_ids repeats 2"):
        ops.gather_pages(layers, torch.tensor([0, 1]), pool, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="block_ids repeats 1"):
        ops.scatter_pages(pool, torch.tensor([0, 1]), layers, torch.tensor([1, 1]))
