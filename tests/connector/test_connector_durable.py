"""The durable path on real engines: gated persistence, restart survival, integrity, kill safety.

The tests pass in any order: the disk tier's state after the restart is taken when the second
engine has started, before any test sends it a request (the flipped-byte test discards a
checkpoint, leaving its good pages unreferenced), and with the system trigger off a request
that misses keeps nothing another test could hit.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from durable_support import (
    blob_paths,
    catalog_page_keys,
    catalog_rows,
    checkpoint_blob_keys,
    prompts,
    setup_dirs,
    start_node,
)
from engine import (
    BLOCK_SIZE,
    baseline_outputs,
    generate_one,
    kvci_params,
    make_llm,
    shutdown,
)

pytestmark = pytest.mark.engine

WRITER = Path(__file__).with_name("durable_writer.py")


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, prompts())


@pytest.fixture(scope="module")
def first_engine(tiny_model, baseline, tmp_path_factory):
    """Runs engine 1 in a subprocess, waits for its READY line, then SIGKILLs it mid-write."""
    root = tmp_path_factory.mktemp("durable")
    extra = setup_dirs(root)
    proc, ready = start_node(WRITER, root, tiny_model, extra)
    time.sleep(3)  # let it get into the middle of more disk writes
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return root, extra, ready


@pytest.fixture(scope="module")
def flipped_blob(first_engine):
    root, extra, ready = first_engine
    disk = Path(extra["disk_root"])
    key = checkpoint_blob_keys(disk, ready["flipped"]["checkpoint_id"])[0]
    (path,) = [p for p in blob_paths(disk) if p.stem == key]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a byte of the page payload
    path.write_bytes(bytes(data))
    return path


@dataclass(frozen=True)
class DiskState:
    """What a disk tier holds, by blob key."""

    blobs: set[str]
    named: set[str]  # the pages of its catalogued checkpoints
    quarantined: set[str]
    torn: list[Path]  # files of unfinished writes

    @classmethod
    def of(cls, disk: Path) -> DiskState:
        return cls(blobs={p.stem for p in blob_paths(disk)},
                   named={k for cid in catalog_rows(disk) for k in checkpoint_blob_keys(disk, cid)},
                   quarantined={p.stem for p in disk.rglob("quarantine/*")},
                   torn=list(disk.rglob("*.tmp*")))


@dataclass(frozen=True)
class Restarted:
    llm: Any
    after_start: DiskState  # as the start-up reconciliation left it, before any request


@pytest.fixture(scope="module")
def second_engine(tiny_model, first_engine, flipped_blob):
    root, extra, _ = first_engine
    llm = make_llm(tiny_model, extra)
    yield Restarted(llm, DiskState.of(Path(extra["disk_root"])))
    shutdown(llm)


def test_refused_persist_writes_nothing_and_names_the_check(first_engine):
    root, extra, ready = first_engine
    refused = ready["refused"]["persist"]
    assert refused["status"] == "refused"
    assert refused["decision"]["failed_check"] == "verified_authority"
    assert ready["refused"]["checkpoint_id"] not in catalog_rows(Path(extra["disk_root"]))
    assert ready["persisted"]["persist"]["status"] in ("persisting", "persisted")


def test_catalog_is_consistent_after_kill(first_engine, second_engine):
    root, extra, _ = first_engine
    disk = Path(extra["disk_root"])
    conn = sqlite3.connect(f"file:{disk / 'catalog.sqlite3'}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        conn.close()
    start = second_engine.after_start
    assert not start.torn  # start-up reconciliation removed torn writes
    assert start.blobs <= start.named | start.quarantined
    # Whatever ran since: every blob is a catalogued page's (a checkpoint that a bad page took
    # with it leaves its other pages unreferenced, blobs and all) or quarantined.
    now = DiskState.of(disk)
    assert not now.torn and now.blobs <= catalog_page_keys(disk) | now.quarantined


def test_persisted_checkpoint_hits_from_disk_after_restart(second_engine, baseline):
    out = generate_one(second_engine.llm, prompts()["persisted"], kvci_params(tenant="acme"))
    said = out.kv_transfer_params["kvci"]  # in the messages: why a hit was missed, if one is
    assert out.num_cached_tokens == 5 * BLOCK_SIZE, said
    assert said["hit_tier"] == "disk", said
    assert list(out.outputs[0].token_ids) == baseline["persisted"]


def test_refused_checkpoint_does_not_survive_restart(second_engine, baseline):
    out = generate_one(second_engine.llm, prompts()["refused"], kvci_params(tenant="acme"))
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == baseline["refused"]


def test_flipped_byte_is_a_load_error_and_recomputes(second_engine, baseline, flipped_blob):
    out = generate_one(second_engine.llm, prompts()["flipped"], kvci_params(tenant="acme"))
    assert list(out.outputs[0].token_ids) == baseline["flipped"]
    # Quarantined, never to be loaded again (the message: what kvci said of the request).
    assert not flipped_blob.exists(), out.kv_transfer_params["kvci"]


def test_other_tenant_never_hits_disk(second_engine, baseline):
    out = generate_one(second_engine.llm, prompts()["persisted"], kvci_params(tenant="globex"))
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == baseline["persisted"]


def test_a_disk_hit_beside_another_request_loads_on_steps_of_its_own(second_engine, baseline):
    # The miss is looked up first, so the hit is not alone: it is read while the miss runs,
    # not before a forward (an asynchronous load), and both outputs are the baseline's.
    from vllm.inputs import TokensPrompt

    names = ["refused", "persisted"]
    outs = second_engine.llm.generate([TokensPrompt(prompt_token_ids=prompts()[n]) for n in names],
                                      kvci_params(tenant="acme"), use_tqdm=False)
    by_name = dict(zip(names, outs, strict=True))
    assert by_name["persisted"].num_cached_tokens == 5 * BLOCK_SIZE
    assert by_name["persisted"].kv_transfer_params["kvci"]["hit_tier"] == "disk"
    for name, out in by_name.items():
        assert list(out.outputs[0].token_ids) == baseline[name], name
