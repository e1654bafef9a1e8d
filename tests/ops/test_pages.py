from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin import ops

from .gil_probe import spins_while


def make_layer(
    generator: torch.Generator, num_blocks: int, page_bytes: int, padding: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer view (num_blocks, page_bytes) of rows `padding` bytes wider: (view, whole)."""
    whole = torch.randint(
        0, 256, (num_blocks, page_bytes + padding), generator=generator, dtype=torch.uint8
    )
    return whole.view(dtype)[:, :page_bytes], whole


def offsets(layers: list[torch.Tensor]) -> list[int]:
    result, at = [], 0
    for layer in layers:
        result.append(at)
        at += layer.shape[1]
    return result


page_sets = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31),
        "num_blocks": st.integers(1, 24),
        "num_slots": st.integers(1, 24),
        "pages": st.lists(
            st.tuples(
                st.integers(1, 300), st.integers(0, 9), st.sampled_from([torch.uint8, torch.int8])
            ),
            min_size=1,
            max_size=4,
        ),
        "slot_extra": st.integers(0, 16),
        "index_dtype": st.sampled_from([torch.int64, torch.int32]),
    }
)


def build(case: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Layer views, the whole tensors behind them, and a pool of random bytes."""
    generator = torch.Generator().manual_seed(case["seed"])
    made = [
        make_layer(generator, case["num_blocks"], size, padding, dtype)
        for size, padding, dtype in case["pages"]
    ]
    layers = [view for view, _ in made]
    slot_bytes = ops.pool_slot_bytes(layers) + case["slot_extra"]
    pool = torch.randint(
        0, 256, (case["num_slots"], slot_bytes), generator=generator, dtype=torch.uint8
    )
    return layers, [whole for _, whole in made], pool


@settings(max_examples=60, deadline=None)
@given(case=page_sets, data=st.data())
def test_gather_copies_pages_into_slots(case: dict, data: st.DataObject) -> None:
    layers, wholes, pool = build(case)
    n = data.draw(st.integers(0, case["num_slots"]))
    slots = data.draw(st.permutations(range(case["num_slots"])))[:n]
    blocks = data.draw(st.lists(st.integers(0, case["num_blocks"] - 1), min_size=n, max_size=n))
    expected = pool.clone()
    for layer, off in zip(layers, offsets(layers), strict=True):
        width = layer.shape[1]
        for slot, block in zip(slots, blocks, strict=True):
            expected[slot, off : off + width] = layer[block].view(torch.uint8)
    before = [whole.clone() for whole in wholes]
    ops.gather_pages(
        layers,
        torch.tensor(blocks, dtype=case["index_dtype"]),
        pool,
        torch.tensor(slots, dtype=case["index_dtype"]),
    )
    assert torch.equal(pool, expected)
    assert all(torch.equal(a, b) for a, b in zip(before, wholes, strict=True))


@settings(max_examples=60, deadline=None)
@given(case=page_sets, data=st.data())
def test_scatter_copies_slots_into_pages(case: dict, data: st.DataObject) -> None:
    layers, wholes, pool = build(case)
    n = data.draw(st.integers(0, case["num_blocks"]))
    blocks = data.draw(st.permutations(range(case["num_blocks"])))[:n]
    slots = data.draw(st.lists(st.integers(0, case["num_slots"] - 1), min_size=n, max_size=n))
    expected = [whole.clone() for whole in wholes]
    for whole, layer, off in zip(expected, layers, offsets(layers), strict=True):
        width = layer.shape[1]
        for slot, block in zip(slots, blocks, strict=True):
            whole[block, :width] = pool[slot, off : off + width]
    pool_before = pool.clone()
    ops.scatter_pages(
        pool,
        torch.tensor(slots, dtype=case["index_dtype"]),
        layers,
        torch.tensor(blocks, dtype=case["index_dtype"]),
    )
    assert all(torch.equal(a, b) for a, b in zip(expected, wholes, strict=True))
    assert torch.equal(pool, pool_before)


@pytest.mark.parametrize("threads", [0, 1, 2, 8])
def test_many_pages_round_trip(threads: int) -> None:
    # 12 MiB: split over copy threads (2 MiB each at least) on a host with more than one core,
    # unless bounded by ``threads``.
    generator = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (2, 600, 2, 8192), generator=generator, dtype=torch.uint8)
    layers = [cache[0].reshape(600, -1), cache[1, :, 0, :]]  # dense pages, then strided rows
    pool = torch.zeros(500, ops.pool_slot_bytes(layers), dtype=torch.uint8)
    blocks = torch.randperm(600, generator=generator)[:500]
    slots = torch.randperm(500, generator=generator)
    ops.gather_pages(layers, blocks, pool, slots, threads=threads)
    assert torch.equal(pool[slots, :16384], layers[0][blocks])
    assert torch.equal(pool[slots, 16384:], layers[1][blocks])
    restored = [torch.zeros_like(layer) for layer in layers]
    ops.scatter_pages(pool, slots, restored, blocks, threads=threads)
    for layer, copy in zip(layers, restored, strict=True):
        assert torch.equal(copy[blocks], layer[blocks])


def test_the_op_releases_the_gil() -> None:
    layers = [torch.zeros(512, 65536, dtype=torch.uint8)]
    pool = torch.empty(512, 65536, dtype=torch.uint8)
    ids = torch.arange(512)

    def work() -> None:
        for _ in range(20):
            ops.gather_pages(layers, ids, pool, ids)

    assert spins_while(work) > 1000


def small_setup() -> tuple[list[torch.Tensor], torch.Tensor]:
    layers = [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.int8)]
    return layers, torch.zeros(3, 12, dtype=torch.uint8)


BAD_INPUT = [
    (
        {"block_ids": torch.tensor([4])},
        IndexError,
        r"block_ids\[0\] = 4 is out of range for layers with num_blocks 4",
    ),
    ({"block_ids": torch.tensor([-1])}, IndexError, r"block_ids\[0\] = -1 is out of range"),
    (
        {"slot_ids": torch.tensor([3])},
        IndexError,
        r"slot_ids\[0\] = 3 is out of range for pool with num_slots 3",
    ),
    (
        {"block_ids": torch.tensor([0, 1]), "slot_ids": torch.tensor([0])},
        ValueError,
        "differ in length",
    ),
    ({"block_ids": torch.tensor([0.0])}, TypeError, "block_ids must be int64 or int32"),
    ({"slot_ids": torch.tensor([[0]])}, ValueError, "slot_ids must be 1-D"),
    ({"slot_ids": [0]}, TypeError, "slot_ids must be a tensor"),
    (
        {"pool": torch.zeros(3, 11, dtype=torch.uint8)},
        ValueError,
        "pool slots hold 11 bytes but one block of every layer needs 12",
    ),
    ({"pool": torch.zeros(3, 12, dtype=torch.int8)}, TypeError, "pool must be uint8"),
    (
        {"pool": torch.zeros(3, 24, dtype=torch.uint8)[:, ::2]},
        ValueError,
        "pool rows must be dense",
    ),
    (
        {"pool": torch.zeros(3, 12, dtype=torch.uint8, device="meta")},
        ValueError,
        "pool must be in host memory",
    ),
    ({"layers": []}, ValueError, "layers must not be empty"),
    ({"layers": [torch.zeros(4, 8)]}, TypeError, r"layers\[0\] must be uint8 or int8"),
    (
        {"layers": [torch.zeros(4, 2, 4, dtype=torch.uint8)]},
        ValueError,
        r"layers\[0\] must be 2-D",
    ),
    (
        {"layers": [torch.zeros(8, 4, dtype=torch.uint8).t()]},
        ValueError,
        r"layers\[0\] rows must be dense",
    ),
    ({"layers": torch.zeros(4, 8, dtype=torch.uint8)}, TypeError, "sequence of tensors"),
    (
        {"layers": [torch.zeros(4, 8, dtype=torch.uint8), "x"]},
        TypeError,
        r"layers\[1\] must be a tensor",
    ),
]


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize(("change", "error", "match"), BAD_INPUT)
def test_bad_input_is_refused(direction: str, change: dict, error: type, match: str) -> None:
    layers, pool = small_setup()
    args = {
        "layers": layers,
        "block_ids": torch.tensor([1]),
        "pool": pool,
        "slot_ids": torch.tensor([2]),
        **change,
    }
    with pytest.raises(error, match=match):
        if direction == "gather":
            ops.gather_pages(args["layers"], args["block_ids"], args["pool"], args["slot_ids"])
        else:
            ops.scatter_pages(args["pool"], args["slot_ids"], args["layers"], args["block_ids"])


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("threads", [-1, True, 1.5])
def test_a_bad_thread_bound_is_refused(direction: str, threads: object) -> None:
    layers, pool = small_setup()
    ids = torch.tensor([1])
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        if direction == "gather":
            ops.gather_pages(layers, ids, pool, ids, threads=threads)  # type: ignore[arg-type]
        else:
            ops.scatter_pages(pool, ids, layers, ids, threads=threads)  # type: ignore[arg-type]
    # The op itself refuses it too, for a caller of torch.ops.kvci directly.
    with pytest.raises(ValueError, match="threads must be >= 0"):
        torch.ops.kvci.scatter_pages(pool, ids, layers, ids, -1)


def test_a_destination_is_written_once() -> None:
    layers, pool = small_setup()
    with pytest.raises(ValueError, match="slot_ids repeats 2"):
        ops.gather_pages(layers, torch.tensor([0, 1]), pool, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="block_ids repeats 1"):
        ops.scatter_pages(pool, torch.tensor([0, 1]), layers, torch.tensor([1, 1]))
    # Repeated sources are fine: one block into two slots.
    ops.gather_pages(layers, torch.tensor([1, 1]), pool, torch.tensor([0, 2]))


def test_block_ids_are_bounded_by_the_smallest_layer() -> None:
    layers = [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(3, 4, dtype=torch.uint8)]
    pool = torch.zeros(2, 12, dtype=torch.uint8)
    with pytest.raises(IndexError, match="num_blocks 3"):
        ops.gather_pages(layers, torch.tensor([3]), pool, torch.tensor([0]))


def test_pool_slot_bytes() -> None:
    layers, _ = small_setup()
    assert ops.pool_slot_bytes(layers) == 12
    with pytest.raises(ValueError, match="layers must not be empty"):
        ops.pool_slot_bytes([])
