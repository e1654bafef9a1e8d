"""LayerwiseLoads on real tensors (no engine): with the forward's thread pinned as vLLM's CPU
worker pins it, a load's layers are copied beside the forward, by a thread on the cores the
forward is not pinned to, each in place by the time the forward waits for it; a copy that fails
there fails the forward's wait for that layer and the step, and the next step loads again."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvci_plugin.connector.layer_loads import LayerPart, LayerSource, LayerwiseLoads

BLOCKS, PAGE = 8, 4096
LAYERS = ("layer.0", "layer.1", "layer.2")

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs a core beside the forward's"
)


@pytest.fixture
def forward_core() -> Iterator[int]:
    """This thread pinned to one core, as vLLM pins its CPU worker's forward."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


def cache() -> tuple[list[LayerPart], dict[str, torch.Tensor]]:
    kv = {name: torch.zeros(BLOCKS, PAGE, dtype=torch.uint8) for name in LAYERS}
    parts = [LayerPart(name, 0, i * PAGE, [kv[name]]) for i, name in enumerate(LAYERS)]
    return parts, kv


def source(seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (4, len(LAYERS) * PAGE), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def expect(pages: torch.Tensor, layer: int, rows: list[int]) -> torch.Tensor:
    return pages[rows, layer * PAGE : (layer + 1) * PAGE]


def copier_threads(before: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """kvci's layer copy threads alive now, but ``before``."""
    return [
        t for t in threading.enumerate() if t.name.startswith("kvci-layers") and t not in before
    ]


def test_layers_are_copied_beside_the_forward_on_another_core(forward_core: int) -> None:
    parts, kv = cache()
    loads = LayerwiseLoads(parts)
    rows, blocks = [2, 0, 3], [5, 1, 6]
    others = frozenset(copier_threads())
    try:
        # The first load: no layer is known to wait, so all are in before start returns.
        first = source(0)
        loads.start([LayerSource(0, first, rows, blocks)], first.numel())
        for i, name in enumerate(LAYERS):
            assert torch.equal(kv[name][blocks], expect(first, i, rows))
            loads.wait(name)
        assert loads.finish() is not None
        assert not copier_threads(others)  # nothing was deferred: no copy thread yet

        for seed in (1, 2):
            pages = source(seed)
            for name in LAYERS:
                kv[name].zero_()
            loads.start([LayerSource(0, pages, rows, blocks)], pages.numel())
            # The forward has not reached any layer, yet the last one lands: copied beside it.
            deadline = time.monotonic() + 30
            while not torch.equal(kv[LAYERS[-1]][blocks], expect(pages, len(LAYERS) - 1, rows)):
                assert time.monotonic() < deadline, "the layers were not copied beside the forward"
                time.sleep(0.001)
            for i, name in enumerate(LAYERS):
                loads.wait(name)
                assert torch.equal(kv[name][blocks], expect(pages, i, rows))
            done = loads.finish()
            assert done is not None and done.nbytes == pages.numel()
        (copier,) = copier_threads(others)
        assert copier.native_id is not None
        beside = os.sched_getaffinity(copier.native_id)
        assert beside and forward_core not in beside
    finally:
        loads.shutdown()
    assert not copier_threads(others)


def test_a_copy_that_fails_beside_the_forward_fails_that_layers_wait_and_the_step(
    forward_core: int,
) -> None:
    parts, kv = cache()
    loads = LayerwiseLoads(parts)
    try:
        good = source(3)
        loads.start([LayerSource(0, good, [0, 1], [2, 3])], good.numel())
        for name in LAYERS:
            loads.wait(name)
        loads.finish()
        # A row past the pages' end: the copy thread's first layer fails.
        loads.start([LayerSource(0, good, [0, 9], [2, 3])], good.numel())
        with pytest.raises(RuntimeError, match="layer.0") as failed:
            loads.wait("layer.0")
        assert isinstance(failed.value.__cause__, IndexError)
        with pytest.raises(RuntimeError, match="loading a step's pages failed"):
            loads.finish()
        # The next step loads as before.
        again = source(4)
        for name in LAYERS:
            kv[name].zero_()
        loads.start([LayerSource(0, again, [3, 2], [0, 7])], again.numel())
        for i, name in enumerate(LAYERS):
            loads.wait(name)
            assert torch.equal(kv[name][[0, 7]], expect(again, i, [3, 2]))
        loads.finish()
    finally:
        loads.shutdown()


def test_an_unpinned_forward_copies_each_layer_itself_when_it_waits() -> None:
    if os.sched_getaffinity(0) != set(range(os.cpu_count() or 1)):
        pytest.skip("this thread is pinned: the layers would be copied beside it")
    parts, kv = cache()
    loads = LayerwiseLoads(parts)
    rows, blocks = [1, 2], [4, 0]
    others = frozenset(copier_threads())
    try:
        first = source(5)
        loads.start([LayerSource(0, first, rows, blocks)], first.numel())
        for name in LAYERS:
            loads.wait(name)
        loads.finish()
        pages = source(6)
        for name in LAYERS:
            kv[name].zero_()
        loads.start([LayerSource(0, pages, rows, blocks)], pages.numel())
        time.sleep(0.05)
        assert not any(kv[name].any() for name in LAYERS)  # none copied before its wait
        loads.wait("layer.1")
        assert torch.equal(kv["layer.1"][blocks], expect(pages, 1, rows))
        assert not kv["layer.0"].any() and not kv["layer.2"].any()
        loads.finish()  # the layers never waited for are in once the step ends
        for i, name in enumerate(LAYERS):
            assert torch.equal(kv[name][blocks], expect(pages, i, rows))
        assert not copier_threads(others)
    finally:
        loads.shutdown()
