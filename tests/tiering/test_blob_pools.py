"""The blob read and write pools are shared by the process, and a forked child gets its own.

vLLM forks its engine core and workers from the process that built the engine, which may have
read or written blobs already: a child must not submit to the parent's pool, whose threads it
does not have (every read would wait forever).
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch

from kvci_plugin.tiering.blob_backend import read_prefix, write_each
from kvci_plugin.tiering.blob_store import BlobStore

NAMESPACE = bytes(range(32))


def _read_back(root: Path, keys: list[bytes], pages: torch.Tensor) -> None:
    out = torch.zeros_like(pages)
    n, error = read_prefix(BlobStore(root, NAMESPACE), keys, "acme", out)
    os._exit(0 if (n, error) == (len(keys), None) and torch.equal(out, pages) else 1)


def test_a_forked_child_reads_with_pools_of_its_own(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, NAMESPACE)
    keys = [os.urandom(16) for _ in range(6)]
    pages = torch.randint(0, 256, (6, 4096), dtype=torch.uint8)
    write_each(store, keys, "acme", pages)
    out = torch.zeros_like(pages)
    assert read_prefix(store, keys, "acme", out) == (6, None)  # the parent's pools now run

    child = multiprocessing.get_context("fork").Process(target=_read_back, args=(tmp_path, keys, pages))
    child.start()
    child.join(timeout=60)
    hung = child.exitcode is None
    if hung:
        child.kill()
    assert not hung, "the forked child's read never finished"
    assert child.exitcode == 0

