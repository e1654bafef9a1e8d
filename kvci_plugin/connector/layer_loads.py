"""LayerwiseLoads: a step's loads on the CPU, each layer in place before the forward reads it.

The pages come from rows of host memory: the RAM tier's slots, or the disk load's verified
staging buffer when the forward's step reads a disk hit itself.

vLLM calls ``wait_for_layer_load(layer)`` before an attention layer reads its KV cache. vLLM pins
its CPU worker's forward to its compute cores and reserves a core beside them for the scheduler
and the API, idle while the forward runs. So the layers are copied by a thread of kvci's own on
the cores the forward is not pinned to, one after another in the order the forward reaches
them, while the forward computes: a layer's wait lasts only until that layer is in, and the
first layer's copy is the only one the forward waits for whole: a fraction of what copying on
the forward's own thread held it (``benchmarks/ttft.py``; the waits are the "layer waits" of
benchmarks/results/README.md, ttft, "Where a hit's time goes"). The copy thread copies on one
thread: a second copy thread would land on the forward's core. Where no core is beside the
forward (an unpinned worker, a one-core host), each layer is copied in ``wait``, on the
forward's thread, its pages still in cache when it reads them.

Only layers seen waiting are deferred. vLLM waits in its attention layers only; a layer it never
waits for before reading (a Mamba layer's state, say) is copied before ``start`` returns, as is
every layer until one forward has shown which layers wait. ``finish`` has every deferred layer
in, waited for or not, so every page is in once the step ends (its slots may be reused).

On a CUDA device the copy stream already overlaps the forward: this is for the CPU.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvci_plugin.connector.pages import slot_bytes
from kvci_plugin.ops import PendingCopy, scatter_pages
from kvci_plugin.ops.affinity import cores_beside_this_thread, pin_to


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
        self._deferred: dict[str, None] = {}  # this step's layers left to copy in ``wait``
        self._jobs: list[_Job] = []
        self._started = 0.0
        self._copy_s = 0.0  # time spent copying this step's pages on the forward's thread
        self._nbytes = 0
        # The thread copying beside the forward (started at the first deferred load; None when
        # no core is beside it), and this step's copy on it: each layer's event is set once the
        # layer is in, or the copy has failed.
        self._beside: ThreadPoolExecutor | None = None
        self._beside_known = False
        self._copying: Future[float] | None = None
        self._ready: dict[str, threading.Event] = {}
        self._copied: set[str] = set()

    def start(self, loads: list[LayerSource], nbytes: int) -> None:
        """Copy ``loads`` of ``nbytes`` in all: the layers the forward is known to wait for by the
        time it does, the others now. Their ``pages`` stay untouched until ``finish`` returns."""
        self.finish()
        self._started, self._nbytes = time.perf_counter(), nbytes
        self._jobs = [(load.group, load.pages, torch.tensor(load.rows, dtype=torch.int64),
                       torch.tensor(load.blocks, dtype=torch.int64)) for load in loads]
        self._deferred = {name: None for name in self._waited if name in self._parts}
        for part in self._parts.values():
            if part.name not in self._deferred:
                self._copy_layer(part)
        self._copy_s = time.perf_counter() - self._started
        beside = self._copier() if self._deferred else None
        if beside is not None:
            order, self._deferred = list(self._deferred), {}
            self._ready = {name: threading.Event() for name in order}
            self._copied = set()
            self._copying = beside.submit(self._copy_in_order, order, self._ready, self._copied)

    @property
    def started(self) -> bool:
        """Whether a ``start`` has not been finished yet (``wait`` does nothing otherwise)."""
        return self._started != 0.0

    def wait(self, name: str) -> None:
        """Before the forward reads layer ``name``: its pages are in. Learned in the steps that
        load (the first copies every layer in ``start``); a step without is a decode step's
        hook, and returns at once."""
        if not self._started:
            return
        self._waited.setdefault(name, None)
        ready = self._ready.get(name)
        if ready is not None:
            ready.wait()
            if name not in self._copied:
                assert self._copying is not None
                raise RuntimeError(f"kvci: loading the pages of layer {name} failed") from (
                    self._copying.exception())
        elif name in self._deferred:
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
        copying, self._copying, self._ready = self._copying, None, {}
        try:
            for name in list(self._deferred):
                self._copy_deferred(name)  # not waited for: not learned as waiting
            seconds = self._copy_s
            if copying is not None:
                try:
                    seconds += copying.result()
                except Exception as exc:
                    raise RuntimeError("kvci: loading a step's pages failed") from exc
        finally:
            self._started, self._jobs = 0.0, []
        return PendingCopy(self._nbytes, seconds_taken=seconds)

    def shutdown(self) -> None:
        try:
            self.finish()
        finally:
            if self._beside is not None:
                self._beside.shutdown()
                self._beside = None

    def _copier(self) -> ThreadPoolExecutor | None:
        """The thread that copies beside the forward, on the cores the forward's thread (the
        caller: vLLM's worker calls ``start`` on it) is not pinned to; None when there are none."""
        if not self._beside_known:
            self._beside_known = True
            cores = cores_beside_this_thread()
            if cores:
                beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvci-layers")
                if beside.submit(pin_to, cores).result():
                    self._beside = beside
                else:
                    beside.shutdown()
        return self._beside

    def _copy_in_order(self, order: list[str], ready: dict[str, threading.Event],
                       copied: set[str]) -> float:
        """On the copy thread: each layer in turn, its event set once it is in. A failure wakes
        every waiter (``wait`` then raises) and is raised by ``finish``."""
        t0 = time.perf_counter()
        try:
            for name in order:
                self._copy_layer(self._parts[name], threads=1)
                copied.add(name)
                ready[name].set()
        finally:
            for event in ready.values():
                event.set()
        return time.perf_counter() - t0

    def _copy_layer(self, part: LayerPart, threads: int = 0) -> None:
        size = self._sizes[part.name]
        for group, pages, rows, blocks in self._jobs:
            if group == part.group:
                scatter_pages(pages[:, part.offset : part.offset + size], rows, part.views, blocks,
                              threads=threads)
