"""PageCopyStream with the KV cache on the CPU: each copy runs before `run` returns, is done,
and carries its bytes and time; there is nothing to fence or hold. (The CUDA ordering is
tested on a GPU: tests/gpu/test_copy_stream_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from kvci_plugin.ops import PageCopyStream


def test_a_copy_on_the_cpu_runs_at_once_and_is_done() -> None:
    copies = PageCopyStream(torch.device("cpu"))
    assert not copies.asynchronous
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    pending = copies.run(lambda: dst.copy_(src), 64)
    assert torch.equal(dst, src)
    assert pending.done() and pending.nbytes == 64
    assert pending.seconds() >= 0
    assert copies.fence() is None
    copies.hold(pending)
    copies.drain()
    pending.wait()


def test_a_failing_copy_raises_to_the_caller() -> None:
    copies = PageCopyStream(torch.device("cpu"))

    def broken() -> None:
        raise ValueError("bad block id")

    with pytest.raises(ValueError, match="bad block id"):
        copies.run(broken, 8)
