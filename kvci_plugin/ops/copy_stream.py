"""PageCopyStream: page copies ordered against the forward pass by a CUDA stream and events.

On a CUDA device each copy runs on a side stream of its own, after the work the calling thread's
current stream (the forward's) had queued so far and after the stream's earlier copies; the
caller learns it is done from its event, never by stalling the forward:
- a load the next forward reads is followed by `hold`: the forward's stream waits for the load on
  the GPU, while the CPU goes on launching it;
- a save started after a forward reads the pages that forward wrote, overlaps the next steps, and
  its pages may be freed or read on the host only once `PendingCopy.done()`.
Elsewhere (the KV cache on the CPU) a copy runs at once and is done on return.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class PendingCopy:
    """One copy queued by `PageCopyStream.run`: its bytes, and on CUDA the events around it."""

    nbytes: int
    seconds_taken: float | None = None  # known at once when the copy ran on the CPU
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.end is None or self.end.query()

    def wait(self) -> None:
        """Block the calling thread until the copy has run."""
        if self.end is not None:
            self.end.synchronize()

    def seconds(self) -> float:
        """How long the copy took on its stream; only once it is done."""
        if self.seconds_taken is None:
            assert self.start is not None and self.end is not None and self.end.query()
            self.seconds_taken = self.start.elapsed_time(self.end) / 1e3
        return self.seconds_taken


class PageCopyStream:
    """Runs page copies for a KV cache on ``device``: on a side stream there if it is CUDA."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @property
    def asynchronous(self) -> bool:
        return self._stream is not None

    def fence(self) -> torch.cuda.Event | None:
        """A point on the calling thread's current stream: the work queued on it so far. Another
        thread's copy passed it as ``after`` waits for that work (current streams are per
        thread)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def run(self, copy: Callable[[], None], nbytes: int, *,
            after: torch.cuda.Event | None = None) -> PendingCopy:
        """Queue ``copy`` (which launches on the current stream) after ``after``, or else after
        the work on the calling thread's current stream so far."""
        if self._stream is None:
            t0 = time.perf_counter()
            copy()
            return PendingCopy(nbytes, seconds_taken=time.perf_counter() - t0)
        if after is None:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        else:
            self._stream.wait_event(after)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            copy()
            end.record(self._stream)
        return PendingCopy(nbytes, start=start, end=end)

    def hold(self, pending: PendingCopy) -> None:
        """Make the calling thread's current stream (the forward) wait on the GPU for
        ``pending``."""
        if pending.end is not None:
            torch.cuda.current_stream(self._device).wait_event(pending.end)

    def drain(self) -> None:
        """Block until every copy queued on this stream has run."""
        if self._stream is not None:
            self._stream.synchronize()
