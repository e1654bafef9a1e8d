"""PagePool: whole-page copies between KV-cache layer views and host slots, checked byte for
byte against plain torch indexing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.tiering.ram.pool import PagePool


def random_bytes(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def bytes_(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


def expected_slot(layers: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([layer[block].view(torch.uint8) for layer in layers])


def kv_layers(num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Layer views as vLLM hands them over: a bf16 cache seen as bytes, a strided byte view whose
    rows are wider than a page, and an int8 view."""
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.randn((num_blocks, 2, 4, 8), dtype=torch.bfloat16, generator=gen)
    wide = random_bytes(num_blocks, 40, seed=seed + 1)
    int8 = random_bytes(num_blocks, 12, seed=seed + 2).view(torch.int8)
    return [bf16.view(torch.uint8).view(num_blocks, -1), wide[:, 8:32], int8]


def test_slot_bytes_is_one_page_of_every_layer() -> None:
    layers = kv_layers(4, seed=0)
    assert PagePool.slot_bytes_for(layers) == 2 * 4 * 8 * 2 + 24 + 12


def test_store_then_load_copies_whole_pages_byte_for_byte() -> None:
    layers = kv_layers(10, seed=1)
    slot_bytes = PagePool.slot_bytes_for(layers)
    pool = PagePool(num_slots=6, slot_bytes=slot_bytes, pin_memory=False)
    blocks, slots = [7, 2, 9], [4, 0, 5]
    pool.store(layers, blocks, slots)
    for block, slot in zip(blocks, slots):
        assert torch.equal(pool.read(slot), expected_slot(layers, block))

    target = [torch.zeros_like(layer) for layer in layers]
    pool.load(torch.tensor(slots), target, torch.tensor([1, 3, 8]))
    for block_src, block_dst in zip(blocks, [1, 3, 8]):
        for src, dst in zip(layers, target):
            assert torch.equal(dst[block_dst], src[block_src])
    untouched = [b for b in range(10) if b not in (1, 3, 8)]
    assert all(not dst[untouched].any() for dst in target)


@settings(max_examples=50, deadline=None)
@given(
    page_sizes=st.lists(st.integers(1, 48), min_size=1, max_size=4),
    num_blocks=st.integers(1, 12),
    data=st.data(),
)
def test_copies_match_torch_indexing(page_sizes: list[int], num_blocks: int, data) -> None:
    layers = [random_bytes(num_blocks, size, seed=i) for i, size in enumerate(page_sizes)]
    pool = PagePool(num_slots=8, slot_bytes=sum(page_sizes), pin_memory=False)
    n = data.draw(st.integers(0, min(num_blocks, 8)))
    blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=n, max_size=n))
    slots = data.draw(st.permutations(range(8)))[:n]
    pool.store(layers, blocks, slots)
    for block, slot in zip(blocks, slots):
        assert torch.equal(pool.read(slot), torch.cat([layer[block] for layer in layers]))

    target = [torch.zeros_like(layer) for layer in layers]
    targets = data.draw(st.permutations(range(num_blocks)))[:n]
    pool.load(slots, target, targets)
    for slot, block in zip(slots, targets):
        assert torch.equal(torch.cat([layer[block] for layer in target]), pool.read(slot))


def test_read_returns_a_copy_and_write_round_trips() -> None:
    pool = PagePool(num_slots=3, slot_bytes=16, pin_memory=False)
    data = random_bytes(16, seed=3)
    pool.write(1, data)
    got = pool.read(1)
    assert torch.equal(got, data)
    got.zero_()
    assert torch.equal(pool.read(1), data)


def test_write_many_and_read_many() -> None:
    pool = PagePool(num_slots=5, slot_bytes=8, pin_memory=False)
    pages = random_bytes(3, 8, seed=4)
    pool.write_many([4, 0, 2], pages)
    assert torch.equal(pool.read_many([2, 4]), pages[[2, 0]])
    assert pool.read_many([]).shape == (0, 8)


def test_pinning_follows_cuda() -> None:
    assert not PagePool(2, 8, pin_memory=False).pinned
    if torch.cuda.is_available():
        assert PagePool(2, 8).pinned
    else:
        assert not PagePool(2, 8).pinned
        with pytest.raises(ValueError, match="pin_memory"):
            PagePool(2, 8, pin_memory=True)


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda p: p.read(3), IndexError, "slot"),
        (lambda p: p.read(-1), IndexError, "slot"),
        (lambda p: p.read(True), TypeError, "slot"),
        (lambda p: p.write(0, bytes_(7)), ValueError, "data"),
        (lambda p: p.write(0, torch.zeros(8, dtype=torch.int16)), ValueError, "data"),
        (lambda p: p.write_many([0, 0], bytes_(2, 8)), ValueError, "distinct"),
        (lambda p: p.write_many([0, 1], bytes_(1, 8)), ValueError, "pages"),
        (lambda p: p.read_many([0, 3]), IndexError, "slot_ids"),
        (lambda p: p.store([bytes_(4, 7)], [0], [0]), ValueError, "layers"),
        (lambda p: p.store([bytes_(4, 8)], [0, 1], [0]), ValueError, "length"),
        (lambda p: p.load([0], [bytes_(4, 8)], torch.zeros(1, 1)), ValueError, "block_ids"),
        (lambda p: p.store([], [0], [0]), ValueError, "layers"),
    ],
)
def test_bad_input_is_refused(call, error: type, field: str) -> None:
    pool = PagePool(num_slots=3, slot_bytes=8, pin_memory=False)
    with pytest.raises(error, match=field):
        call(pool)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_slots": 0, "slot_bytes": 8}, ValueError),
        ({"num_slots": 2, "slot_bytes": 0}, ValueError),
        ({"num_slots": 2, "slot_bytes": 8, "pin_memory": "yes"}, TypeError),
    ],
)
def test_bad_construction_is_refused(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        PagePool(**kwargs)
