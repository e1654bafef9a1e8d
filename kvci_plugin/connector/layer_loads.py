"""LayerwiseLoads: a step's RAM loads on the CPU, copied a layer at a time beside the forward.

vLLM calls ``wait_for_layer_load(layer)`` before an attention layer reads its KV cache. A load
copied whole in ``start_load_kv`` holds the whole forward back for it (a 4k-token hit on the TTFT
benchmark's model: ~3 ms, a tenth of its forward). Copied here on a thread of its own, layer by
layer in the order the forward reached them, the forward waits only for the pages of a layer it
reaches before they are in: mostly the first.

Only layers seen waiting are deferred. vLLM waits in its attention layers only; a layer it never
waits for before reading (a Mamba layer's state, say) is copied before ``start`` returns, as is
every layer until one forward has shown which layers wait. ``finish`` waits for every copy, so
nothing is in flight past the step (its pages' slots may be reused after it).

On a CUDA device the copy stream already overlaps the forward: this is for the CPU.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvci_plugin.ops import PendingCopy
from kvci_plugin.ops.affinity import on_any_core
from kvci_plugin.tiering.page_pool import PagePool


_Job = tuple[int, torch.Tensor, torch.Tensor]  # a group, its slots and blocks


@dataclass(frozen=True)
class LayerPart:
    """One layer's pages within a slot of its group: at byte ``offset``, these page views."""

    name: str
    group: int
    offset: int
    views: list[torch.Tensor]


class LayerwiseLoads:
    def __init__(self, pool: PagePool, parts: list[LayerPart]) -> None:
        self._pool = pool
        self._parts = {part.name: part for part in parts}
        # The layers the forward waited for, in the order it reached them (learned, not assumed).
        self._waited: dict[str, None] = {}
        self._ready: dict[str, threading.Event] = {}
        self._error: BaseException | None = None
        self._copy: Future[None] | None = None
        self._started = self._ended = 0.0
        self._nbytes = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvci-load",
                                          initializer=on_any_core)

    def start(self, loads: list[tuple[int, list[int], list[int]]], nbytes: int) -> None:
        """Copy ``(group, slots, blocks)`` loads of ``nbytes`` in all: the layers the forward is
        known to wait for on the load thread, the others now."""
        self.finish()
        self._started, self._nbytes = time.perf_counter(), nbytes
        jobs = [(group, torch.tensor(slots, dtype=torch.int64), torch.tensor(blocks, dtype=torch.int64))
                for group, slots, blocks in loads]
        deferred = [name for name in self._waited if name in self._parts]
        for part in self._parts.values():
            if part.name not in self._waited:
                self._copy_layer(part, jobs)
        self._ended = time.perf_counter()
        if deferred:
            self._error = None
            self._ready = {name: threading.Event() for name in deferred}
            self._copy = self._thread.submit(self._copy_layers, deferred, jobs)

    def wait(self, name: str) -> None:
        """Before the forward reads layer ``name``: its pages are in."""
        self._waited.setdefault(name, None)
        ready = self._ready.get(name)
        if ready is None:
            return
        ready.wait()
        if self._error is not None:
            raise RuntimeError(f"kvci: loading the pages of layer {name} failed") from self._error

    def finish(self) -> PendingCopy | None:
        """Wait for every copy of the last ``start``; its bytes and how long the copies took,
        from the start to the last one's end (None when nothing was started since)."""
        if self._started == 0.0:
            return None
        if self._copy is not None:
            copy, self._copy = self._copy, None
            copy.result()
        self._ready = {}
        done = PendingCopy(self._nbytes, seconds_taken=self._ended - self._started)
        self._started = 0.0
        return done

    def shutdown(self) -> None:
        self.finish()
        self._thread.shutdown(wait=True)

    def _copy_layers(self, names: list[str], jobs: list[_Job]) -> None:
        try:
            for name in names:
                self._copy_layer(self._parts[name], jobs)
                self._ready[name].set()
            self._ended = time.perf_counter()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            for ready in self._ready.values():
                ready.set()  # a waiter on a failed copy wakes and raises

    def _copy_layer(self, part: LayerPart, jobs: list[_Job]) -> None:
        for group, slots, blocks in jobs:
            if group == part.group:
                self._pool.load_part(slots, part.views, blocks, part.offset)
