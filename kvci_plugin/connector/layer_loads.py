"""LayerwiseLoads: a step's loads on the CPU, each layer copied when the forward reaches it.

The pages come from rows of host memory: the RAM tier's slots, or the disk load's verified
staging buffer when the forward's step reads a disk hit itself.

vLLM calls ``wait_for_layer_load(layer)`` before an attention layer reads its KV cache. A load
copied whole in ``start_load_kv`` makes the forward read pages that left the CPU's caches while
the other layers were copied; one copied on a thread of its own beside the forward competes
with it for the cores and the memory bus. Copied in ``wait``, on the forward's own thread, a
layer's pages are read while still in cache: in one engine, a 4k-token RAM hit took 1.04-1.05x
vLLM's prefix-cache hit of the same prompt this way, 1.13x either other way (the copy before
the forward: 2.6 ms; beside it on a thread: the forward 3 ms slower).

Only layers seen waiting are deferred. vLLM waits in its attention layers only; a layer it never
waits for before reading (a Mamba layer's state, say) is copied before ``start`` returns, as is
every layer until one forward has shown which layers wait. ``finish`` copies any deferred layer
the forward did not wait for, so every page is in once the step ends (its slots may be reused).

On a CUDA device the copy stream already overlaps the forward: this is for the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvci_plugin.connector.pages import slot_bytes
from kvci_plugin.ops import PendingCopy, scatter_pages


@dataclass(frozen=True)
class LayerSource:
    """Pages for one KV cache group's blocks: row ``rows[i]`` of ``pages`` holds every layer's
    page of block ``blocks[i]``, laid out as a slot of the group."""

    group: int
    pages: torch.Tensor
    rows: list[int]
    blocks: list[int]


_Job = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]  # group, pages, rows, blocks


@dataclass(frozen=True)
class LayerPart:
    """One layer's pages within a slot of its group: at byte ``offset``, these page views."""

    name: str
    group: int
    offset: int
    views: list[torch.Tensor]


class LayerwiseLoads:
    def __init__(self, parts: list[LayerPart]) -> None:
        self._parts = {part.name: part for part in parts}
        self._sizes = {part.name: slot_bytes(part.views) for part in parts}
        # The layers the forward waited for, in the order it reached them (learned, not assumed).
        self._waited: dict[str, None] = {}
        self._deferred: dict[str, None] = {}  # this step's layers not copied yet
        self._jobs: list[_Job] = []
        self._started = 0.0
        self._copy_s = 0.0  # time spent copying this step's pages
        self._nbytes = 0

    def start(self, loads: list[LayerSource], nbytes: int) -> None:
        """Copy ``loads`` of ``nbytes`` in all: the layers the forward is known to wait for when
        it does, the others now. Their ``pages`` stay untouched until ``finish`` returns."""
        self.finish()
        self._started, self._nbytes = time.perf_counter(), nbytes
        self._jobs = [(load.group, load.pages, torch.tensor(load.rows, dtype=torch.int64),
                       torch.tensor(load.blocks, dtype=torch.int64)) for load in loads]
        self._deferred = {name: None for name in self._waited if name in self._parts}
        for part in self._parts.values():
            if part.name not in self._deferred:
                self._copy_layer(part)
        self._copy_s = time.perf_counter() - self._started

    def wait(self, name: str) -> None:
        """Before the forward reads layer ``name``: its pages are in."""
        self._waited.setdefault(name, None)
        if name in self._deferred:
            self._copy_deferred(name)

    def _copy_deferred(self, name: str) -> None:
        del self._deferred[name]
        t0 = time.perf_counter()
        try:
            self._copy_layer(self._parts[name])
        except Exception as exc:
            raise RuntimeError(f"kvci: loading the pages of layer {name} failed") from exc
        self._copy_s += time.perf_counter() - t0

    def finish(self) -> PendingCopy | None:
        """Every page of the last ``start`` is in; its bytes and the time its copies took (None
        when nothing was started since)."""
        if self._started == 0.0:
            return None
        for name in list(self._deferred):
            self._copy_deferred(name)  # not waited for: not learned as waiting
        done = PendingCopy(self._nbytes, seconds_taken=self._copy_s)
        self._started, self._jobs = 0.0, []
        return done

    def shutdown(self) -> None:
        self.finish()

    def _copy_layer(self, part: LayerPart) -> None:
        size = self._sizes[part.name]
        for group, pages, rows, blocks in self._jobs:
            if group == part.group:
                scatter_pages(pages[:, part.offset : part.offset + size], rows, part.views, blocks)
