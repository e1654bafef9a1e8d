"""Threads of kvci's own copies and reads, free of the compute cores vLLM pins its worker to."""

from __future__ import annotations

import os


def on_any_core() -> None:
    """Let the calling thread run on any core this process's cpuset allows (the kernel narrows
    the mask to it). vLLM's CPU worker pins its threads to its compute cores and a new thread
    inherits the pin, so kvci's copies and blob reads would queue behind the forward on those
    cores while the core vLLM reserves beside them sits idle (the native page copies' helper
    threads do the same)."""
    pin_to(set(range(os.cpu_count() or 1)))  # refused: the inherited mask stays (slower, not wrong)


def cores_beside_this_thread() -> set[int]:
    """The cores the calling thread is not pinned to: where a thread may work beside it without
    taking its time (empty when it may run on every core). The process's cpuset may allow fewer:
    ``pin_to`` says whether any of them is allowed."""
    return set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)


def pin_to(cores: set[int]) -> bool:
    """Pin the calling thread to ``cores`` (narrowed by the kernel to the cpuset); False, with
    the thread's mask unchanged, when the cpuset allows none of them."""
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        return False
    return True
