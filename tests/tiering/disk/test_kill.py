"""A writer SIGKILLed at random moments never leaves a torn or inconsistent disk tier.

A writer process persists (and sometimes loads) random checkpoints in a loop, with shared pages,
short retentions that garbage collection removes and, in "tight" rounds, a disk bound that
forces eviction. The parent kills it at a random moment, reopens the folder, and checks the
catalog, every checkpoint, every blob on disk and the bound.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from support.disk_tier import DiskTierForTests

from kvci_plugin.tiering.blobs.folder import BlobStore, blob_files, temp_files
from kvci_plugin.tiering.disk.tier import CATALOG_NAME

NS = hashlib.sha256(b"kill-test-namespace").digest()
SLOT = 4096
ROOMY = 4096 * SLOT
TIGHT = 24 * SLOT
ROUNDS = 6
REPO = Path(__file__).resolve().parents[3]

# Imports torch once, then forks one writer per round on request, so that each round costs
# the writer's run time rather than a torch import. No torch op runs before a fork.
ZYGOTE = textwrap.dedent(
    r"""
    import hashlib, os, random, sys, time, traceback
    from pathlib import Path
    import torch
    sys.path.insert(0, "tests")  # the repository is the working folder
    from support.disk_tier import DiskTierForTests

    ns, slot = bytes.fromhex(sys.argv[1]), int(sys.argv[2])

    def page_of(key):
        return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(slot)), dtype=torch.uint8)

    def write_forever(root, seed, disk_bytes, log):
        rng = random.Random(seed)
        store = DiskTierForTests(root, ns, disk_bytes)
        log.write("ready\n")
        for i in range(1_000_000):
            tenant = rng.choice(["alice", "bob"])
            shared = [
                hashlib.sha256(f"{tenant}/{j}".encode()).digest()[:16]
                for j in range(rng.randint(0, 3))
            ]
            keys = shared + [rng.randbytes(16) for _ in range(rng.randint(1, 4))]
            short = rng.random() < 0.25
            expiry = time.time() + 0.05 if short else rng.choice([None, time.time() + 3600])
            checkpoint_id = f"r{seed}-{i}"
            try:
                store.persist(
                    checkpoint_id, tenant, keys, torch.stack([page_of(k) for k in keys]),
                    "system", "{}", "{}", expiry,
                )
            except ValueError:
                if short:  # its retention ran out while its blobs were written
                    continue
                raise
            log.write(f"persisted {checkpoint_id} {'short' if short else 'kept'}\n")
            if not short and rng.random() < 0.3:
                store.load(checkpoint_id, tenant)

    for line in sys.stdin:
        root, seed, disk_bytes, log_path = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                with open(log_path, "w", buffering=1) as log:
                    try:
                        write_forever(Path(root), int(seed), int(disk_bytes), log)
                    except BaseException:
                        log.write(traceback.format_exc())
            finally:
                os._exit(1)  # never back into the zygote's loop
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
    """
)


def page_of(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(SLOT)), dtype=torch.uint8)


def run_and_kill(
    zygote: subprocess.Popen[str], root: Path, seed: int, disk_bytes: int, delay: float
) -> list[list[str]]:
    """Fork a writer, SIGKILL it ``delay`` seconds into its loop; what it reported persisted."""
    log = root.parent / f"writer-{seed}.log"
    zygote.stdin.write(f"{root} {seed} {disk_bytes} {log}\n")
    zygote.stdin.flush()
    pid_line = zygote.stdout.readline()
    assert pid_line.startswith("pid "), zygote.stderr.read()
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().startswith("ready\n")):
        assert time.monotonic() < deadline, "the writer never became ready"
        time.sleep(0.01)
    time.sleep(delay)
    try:
        os.kill(int(pid_line.split()[1]), signal.SIGKILL)
    except ProcessLookupError:
        pass  # it died on its own: the exit line below says how
    exit_line = zygote.stdout.readline()
    assert exit_line == f"exit {-signal.SIGKILL}\n", log.read_text()[-3000:]
    lines = log.read_text().splitlines()
    return [line.split()[1:] for line in lines if line.startswith("persisted ")]


def check_consistent(root: Path, disk_bytes: int, durable: list[str]) -> None:
    frozen = time.time()
    with DiskTierForTests(root, NS, disk_bytes, clock=lambda: frozen) as store:
        assert list(temp_files(root)) == []
        with sqlite3.connect(root / CATALOG_NAME) as db:
            assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert db.execute("PRAGMA foreign_key_check").fetchall() == []
            # Each checkpoint row came with all of its page rows, in one transaction.
            assert db.execute(
                "SELECT checkpoint_id FROM checkpoints AS c WHERE page_count !="
                " (SELECT count(*) FROM checkpoint_pages AS cp"
                " WHERE cp.checkpoint_id = c.checkpoint_id)"
            ).fetchall() == []
            tenants = {key: tenant for key, tenant in db.execute("SELECT key, tenant FROM pages")}

        records = {r.checkpoint_id: r for r in store.list()}
        for checkpoint_id in durable:
            assert checkpoint_id in records, f"durable checkpoint {checkpoint_id} lost"
        for record in records.values():
            loaded = store.load(record.checkpoint_id, record.tenant)
            assert torch.equal(loaded, torch.stack([page_of(k) for k in record.page_keys]))

        # Every blob left on disk has its row and verifies: nothing torn is loadable.
        blobs = BlobStore(root, NS)
        on_disk = sorted(key_hex for _, key_hex, _ in blob_files(root))
        assert on_disk == sorted(tenants)
        for key_hex in on_disk:
            key = bytes.fromhex(key_hex)
            assert torch.equal(blobs.read(key, tenants[key_hex]), page_of(key))

        stats = store.stats()
        assert stats.quarantined == 0
        assert stats.bytes_used <= disk_bytes


def test_sigkill_at_random_moments_leaves_a_consistent_store(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    rng = random.Random(20261130)
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, NS.hex(), str(SLOT)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        persisted = 0
        for seed in range(ROUNDS):
            disk_bytes = TIGHT if seed % 2 else ROOMY
            reported = run_and_kill(zygote, root, seed, disk_bytes, rng.uniform(0.02, 0.5))
            persisted += len(reported)
            # Without eviction pressure, every reported checkpoint without a short retention
            # must survive the kill.
            kept = [cid for cid, kind in reported if kind == "kept"]
            durable = [] if disk_bytes == TIGHT else kept
            check_consistent(root, disk_bytes, durable)
        assert persisted > 0, "the writers were killed before they persisted anything"
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
