"""Timestamps of a connector's hooks, for the TTFT benchmark's per-phase breakdown of a hit.

``benchmarks.ttft`` loads these subclasses (``kv_connector_module_path``) in place of kvci's
connector and vLLM's ExampleConnector: each hook runs the parent's code unchanged between two
``time.perf_counter()`` readings (CLOCK_MONOTONIC, one clock for every process on the machine),
and each process appends its records, one JSON line per engine step, to a file of its own in
the folder named by the ``trace_dir`` key of ``kv_connector_extra_config`` (removed before the
parent reads the config). kvci's worker stats (the disk load's read and scatter times) are
recorded as they pass. Nothing here changes what the hooks do or what they return.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from benchmarks.ttft import TRACE_KEY
from kvci_plugin.connector.connector import KVCheckpointConnector


class _Trace:
    def __init__(self, folder: str, role: str) -> None:
        # Opened once, unbuffered: a flush is one write, not an open and a close (traced decode
        # steps: the worker's flush 90 -> 52 us, the scheduler's 35 -> 13 us), a cost the
        # untraced prefix-cache floor never pays.
        self._fd = os.open(Path(folder) / f"{role}-{os.getpid()}.jsonl",
                           os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._records: list[list[Any]] = []

    def add(self, hook: str, start: float, end: float, extra: Any = None) -> None:
        self._records.append([hook, start, end, extra])

    def flush(self) -> None:
        """Write the records; this write's own time is the first record of the next, so a step's
        time can be counted without the tracer's (``benchmarks.ttft.step_share``)."""
        if self._records:
            start = time.perf_counter()
            os.write(self._fd, (json.dumps(self._records) + "\n").encode())
            self._records = [["trace_flush", start, time.perf_counter(), None]]


def _timed(name: str, *, flush: bool = False):
    def hook(self: _Traced, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = getattr(super(_Traced, self), name)(*args, **kwargs)
        extra = None
        if name == "get_num_new_matched_tokens":
            extra = out[0]
        elif name == "build_connector_meta":
            extra = args[0].total_num_scheduled_tokens
        elif name == "get_kv_connector_stats" and out is not None:
            extra = out.data.get("latency") or None
        self._trace.add(name, start, time.perf_counter(), extra)
        if flush:
            self._trace.flush()
        return out

    hook.__name__ = name
    return hook


class _Traced:
    """Put before a connector class: its hooks, timed."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        folder = vllm_config.kv_transfer_config.kv_connector_extra_config.pop(TRACE_KEY)
        super().__init__(vllm_config, role, kv_cache_config)
        self._trace = _Trace(folder, role.name.lower())

    # Every hook vLLM calls in a step of either role, so their sum is what the connector costs a
    # step.
    get_num_new_matched_tokens = _timed("get_num_new_matched_tokens")
    update_state_after_alloc = _timed("update_state_after_alloc")
    build_connector_meta = _timed("build_connector_meta", flush=True)
    update_connector_output = _timed("update_connector_output")
    take_events = _timed("take_events")
    has_pending_push_work = _timed("has_pending_push_work")
    bind_connector_metadata = _timed("bind_connector_metadata")
    start_load_kv = _timed("start_load_kv")
    wait_for_layer_load = _timed("wait_for_layer_load")
    save_kv_layer = _timed("save_kv_layer")
    wait_for_save = _timed("wait_for_save")
    get_finished = _timed("get_finished")
    get_block_ids_with_load_errors = _timed("get_block_ids_with_load_errors")
    build_connector_worker_meta = _timed("build_connector_worker_meta")
    clear_connector_metadata = _timed("clear_connector_metadata")
    # The worker's last hook of a step; kvci's stats carry the disk load's phases.
    get_kv_connector_stats = _timed("get_kv_connector_stats", flush=True)
    # The scheduler's, per request: a finished request's reply waits for them. Written at once,
    # as the engine may take no further step.
    get_external_cache_hit_sources = _timed("get_external_cache_hit_sources")
    request_finished = _timed("request_finished", flush=True)


class TracedKVCheckpointConnector(_Traced, KVCheckpointConnector):
    # vLLM calls this in place of ``request_finished`` for a connector that supports the hybrid
    # allocator (ExampleConnector does not).
    request_finished_all_groups = _timed("request_finished_all_groups", flush=True)


class TracedExampleConnector(_Traced, ExampleConnector):
    pass
