"""A fault replay's log: its own progress lines (``say``, to stderr), every line this process and
the engine core write (``OutputTee``), and of those the ones a report keeps (``key_lines``: kvci's,
every error and traceback line)."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence

from benchmarks.faultsim.report import LogLine

MAX_LOG_LINES = 80


def say(message: str) -> None:
    print(f"[fault_replay] {message}", file=sys.stderr, flush=True)


class OutputTee:
    """File descriptors 1 and 2 through pipes: what this process and its children (the engine
    core) write still reaches them (vLLM logs to stdout, tracebacks go to stderr), and is kept,
    line by line, for the report."""

    def __init__(self, limit: int = 200_000) -> None:
        self.lines: list[str] = []
        self._limit = limit
        self._lock = threading.Lock()
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> OutputTee:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            self._saved[fd] = os.dup(fd)
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            thread = threading.Thread(
                target=self._pump, args=(read, self._saved[fd]), name=f"tee-{fd}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _pump(self, read: int, out: int) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(read, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            try:
                os.write(out, chunk)
            except OSError:
                pass
            pending += chunk
            *done, pending = pending.split(b"\n")
            with self._lock:
                if len(self.lines) < self._limit:
                    self.lines.extend(line.decode(errors="replace") for line in done)

    def mark(self) -> int:
        with self._lock:
            return len(self.lines)

    def since(self, mark: int) -> list[str]:
        time.sleep(0.2)  # the engine core's last lines, still in the pipe
        with self._lock:
            return self.lines[mark:]

    def __exit__(self, *exc: object) -> None:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            os.dup2(self._saved[fd], fd)
            os.close(self._saved[fd])
        for thread in self._threads:
            thread.join(timeout=2)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(
    r"\b\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\b|\bpid=\d+\b|0x[0-9a-f]{6,}|\b[0-9a-f]{32}\b"
)
_KEY_LINE = re.compile(
    r"kvci|Traceback|Error|Exception|^\s+File \"|^\s*raise |timed out|Timeout", re.IGNORECASE
)


def key_lines(lines: Sequence[str]) -> list[LogLine]:
    """kvci's lines and every error or traceback line, stamps and ids blanked so that repeats
    count as one, first seen first."""
    counts: Counter[str] = Counter()
    order: list[str] = []
    for raw in lines:
        line = _ANSI.sub("", raw).rstrip()
        if not line or not _KEY_LINE.search(line) or line.startswith("[fault_replay]"):
            continue
        line = _STAMP.sub("…", line)[:400]
        if line not in counts:
            order.append(line)
        counts[line] += 1
    return [LogLine(line=line, count=counts[line]) for line in order[:MAX_LOG_LINES]]
