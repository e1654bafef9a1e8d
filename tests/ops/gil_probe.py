"""Whether a native op lets other Python threads run while it works."""

from __future__ import annotations

import threading
from collections.abc import Callable


def spins_while(work: Callable[[], object]) -> int:
    """Run `work` on a worker thread and count this thread's loop turns until it finishes.

    Were the GIL held for the whole of `work`, this thread could not run until it returned, and
    the count would stay near zero.
    """
    started = threading.Event()
    finished = threading.Event()

    def run() -> None:
        started.set()
        work()
        finished.set()

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    spins = 0
    while not finished.is_set():
        spins += 1
    worker.join()
    return spins
