"""PageCopyStream on a GPU: a copy waits for the forward's work queued before it, the forward
waits for a held load, and a copy is not done before it has run.

Each test stalls one stream for tens of milliseconds (``torch.cuda._sleep``) so that a missing
wait would let the other stream read or write first, and the bytes would show it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvci_plugin.ops import PageCopyStream

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STALL_CYCLES = 200_000_000  # about 0.1 s at H200 clocks
MIB = 1 << 20


@pytest.fixture
def copies() -> PageCopyStream:
    return PageCopyStream(torch.device("cuda"))


def test_a_copy_reads_what_the_forward_wrote_before_it(copies: PageCopyStream) -> None:
    cache = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
    host = torch.zeros(MIB, dtype=torch.uint8, pin_memory=True)
    torch.cuda._sleep(STALL_CYCLES)  # a long forward, then it writes the page
    cache.fill_(7)
    pending = copies.run(lambda: host.copy_(cache, non_blocking=True), MIB)
    pending.wait()
    assert pending.done()
    assert bool((host == 7).all())
    assert pending.seconds() > 0


def test_a_copy_after_a_fence_from_another_thread_reads_what_came_before_it(
        copies: PageCopyStream) -> None:
    cache = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
    host = torch.zeros(MIB, dtype=torch.uint8, pin_memory=True)
    # vLLM's forward runs on a stream of its own, not the default (legacy) stream that every
    # thread shares: only the fence orders the I/O thread's copy after it.
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(STALL_CYCLES)
        cache.fill_(9)
        fence = copies.fence()
    worker = threading.Thread(target=lambda: copies.run(
        lambda: host.copy_(cache, non_blocking=True), MIB, after=fence).wait())
    worker.start()
    worker.join()
    assert bool((host == 9).all())


def test_the_forward_waits_for_a_held_load(copies: PageCopyStream) -> None:
    cache = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
    host = torch.full((MIB,), 5, dtype=torch.uint8).pin_memory()

    def slow_load() -> None:
        torch.cuda._sleep(STALL_CYCLES)  # on the copy stream: the load lands late
        cache.copy_(host, non_blocking=True)

    pending = copies.run(slow_load, MIB)
    assert not pending.done()
    copies.hold(pending)
    seen = cache.clone()  # the forward's first read, on its own stream
    assert bool((seen == 5).all())


def test_drain_waits_for_every_queued_copy(copies: PageCopyStream) -> None:
    cache = torch.full((MIB,), 3, dtype=torch.uint8, device="cuda")
    host = torch.zeros(MIB, dtype=torch.uint8, pin_memory=True)

    def slow_save() -> None:
        torch.cuda._sleep(STALL_CYCLES)
        host.copy_(cache, non_blocking=True)

    pending = copies.run(slow_save, MIB)
    copies.drain()
    assert pending.done()
    assert bool((host == 3).all())
