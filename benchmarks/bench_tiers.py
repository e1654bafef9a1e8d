"""Store and load throughput of the RAM and disk tiers, next to what the hardware gives for free.

One checkpoint of ``--pages`` pages of ``--slot-kib`` KiB is stored and loaded through each path;
every figure is the median of ``--repeats`` runs, in GB/s of page bytes, and as a ratio to a
plain tensor copy of the same bytes (the ceiling for the RAM tier). The disk tier is put next to
a plain file write and read of the same bytes (write, fsync; the ceiling for the disk tier), and
to what authenticating the bytes costs: every disk blob is sealed with AES-256-GCM in 1 MiB
segments (``blobs.codec``), so sealing and opening (decrypting straight into the load's buffer,
one thread and the read pool's threads) are measured page by page through the codec, beside the
keyed MACs that would authenticate without encrypting (HMAC-SHA256, keyed BLAKE2b), XXH3-128
(the unkeyed checksum of the first format) and SHA-256. A checkpoint's blobs are also read on
one thread, on the read pool's threads (each reading and opening a run of pages) and as a prefix
load reads them (``read_ahead``: one thread reads the files a chunk ahead while the caller opens
them; try ``--slot-kib 256`` and ``--slot-kib 1024``).

The tiers are driven as the connector drives them in vLLM, its scheduler and worker halves in
one process. RAM, put: ``RAMIndex.reserve`` for the checkpoint's keys, the worker's gather of the
blocks of every layer of a paged KV cache (``--layers`` layers, a page of each per slot) into the
pool's slots (``PagePool.store``), ``commit``; load: ``pin``, the scatter of the slots into other
blocks of the cache (``PagePool.load``), ``unpin``. Disk, persist: the scheduler's lease
(``KVCheckpointStore.reserve``), the worker's read of the RAM slots and ``write_many`` of the
blobs into the tier's folder, the scheduler's ``record_written`` (the catalog row, then the
bound); load: the scheduler's lookup (``longest_prefix``), the worker's ``read_many`` of the
blobs into a host buffer (the worker's staging buffer; its scatter into the KV cache is the RAM
load's copy), the scheduler's ``touch``. Until #48 these figures came from test-only compositions
(a RAM store copying whole page tensors in and out, and the disk tier's own ``persist`` /
``load``), which the engine never runs; the labels and what each figure measures are otherwise
the same.

Disk loads are measured twice: "warm" reads hit the page cache (a checkpoint loaded soon after
it was written), "cold" ones follow ``posix_fadvise(DONTNEED)`` on every file, which drops clean
cached pages without root (it does nothing on tmpfs: the file system type is printed).

    .venv/bin/python -m benchmarks.bench_tiers [--pages N] [--slot-kib K] [--layers L]
                                            [--repeats R] [--dir D] [--threads T]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import xxhash

from kvci_plugin.tiering.blobs.codec import encode, open_page
from kvci_plugin.tiering.blobs.factory import open_blob_root
from kvci_plugin.tiering.blobs.folder import BlobStore, blob_files
from kvci_plugin.tiering.blobs.parallel import read_threads, thread_pool
from kvci_plugin.tiering.blobs.tenant_keys import MemoryMaterials, TenantKeys
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.pool import PagePool

NAMESPACE = hashlib.sha256(b"bench_tiers").digest()
TENANT = "bench"


def median_seconds(
    run: Callable[[int], object], repeats: int, before: Callable[[int], object] | None = None
) -> float:
    """Median wall time of ``run(i)``; ``before(i)`` runs untimed first (to drop caches)."""
    samples = []
    for i in range(repeats):
        if before is not None:
            before(i)
        start = time.perf_counter()
        run(i)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fresh_keys(repeat: int, pages: int) -> list[bytes]:
    return [hashlib.sha256(f"{repeat}/{i}".encode()).digest()[:16] for i in range(pages)]


def drop_cache(paths: Iterable[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def file_system(path: Path) -> str:
    """The type of the file system holding ``path``, from /proc/self/mounts."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type, *_ = line.split()
            inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) > len(best):
                best, kind = mount_point, fs_type
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--slot-kib", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2,
                        help="layers of the paged KV cache a slot holds a page of each of")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where a temp folder is made")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    slot, repeats = args.slot_kib * 1024, args.repeats
    nbytes = args.pages * slot
    src = torch.randint(0, 256, (args.pages, slot), dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched once, so copies into it are not page faults
    view = src.numpy()
    results: list[tuple[str, float]] = []

    def record(label: str, seconds: float) -> None:
        results.append((label, nbytes / seconds / 1e9))

    record("tensor copy (RAM ceiling)", median_seconds(lambda _: dst.copy_(src), repeats))
    mac_key = os.urandom(32)
    record("xxh3-128 of the bytes (v1 checksum)",
           median_seconds(lambda _: xxhash.xxh3_128(view).digest(), repeats))
    record("sha256 of the bytes", median_seconds(lambda _: hashlib.sha256(view).digest(), repeats))
    record("hmac-sha256 of the bytes", median_seconds(
        lambda _: hmac.digest(mac_key, view, "sha256"), repeats))
    record("keyed blake2b of the bytes", median_seconds(
        lambda _: hashlib.blake2b(view, key=mac_key).digest(), repeats))

    keys = TenantKeys(os.urandom(32), MemoryMaterials())
    seal, page_keys = keys.for_write(TENANT, NAMESPACE), fresh_keys(0, args.pages)
    sealed: list[bytearray] = []

    def seal_pages(_: int) -> None:
        sealed[:] = [encode(seal, NAMESPACE, k, src[i]) for i, k in enumerate(page_keys)]

    def open_one(i: int) -> None:
        open_page(sealed[i], keys, TENANT, NAMESPACE, page_keys[i], dst[i], _never)

    record("aes-256-gcm seal, 1 thread", median_seconds(seal_pages, repeats))
    record("aes-256-gcm open into buffer, 1 thread", median_seconds(
        lambda _: [open_one(i) for i in range(args.pages)], repeats))
    threads = read_threads()
    pool = thread_pool("read", threads)
    record(f"aes-256-gcm open into buffer, {threads} threads", median_seconds(
        lambda _: list(pool.map(open_one, range(args.pages))), repeats))
    assert torch.equal(dst, src)

    # A paged KV cache of --layers layers: a page is a block of every layer. The checkpoint's
    # blocks are the first --pages; a load scatters into the next --pages.
    if slot % args.layers:
        parser.error(f"--slot-kib {args.slot_kib} KiB is no whole number of bytes per layer")
    layer_src = src.view(args.pages, args.layers, slot // args.layers)
    cache = [torch.cat([layer_src[:, i], torch.zeros_like(layer_src[:, i])])
             for i in range(args.layers)]
    stored, loaded = torch.arange(args.pages), torch.arange(args.pages, 2 * args.pages)
    index = RAMIndex(num_slots=2 * args.pages, slot_bytes=slot, max_entries=4096)
    ram_pool = PagePool(2 * args.pages, slot)
    ram_keys: list[list[bytes]] = []

    def ram_put(i: int) -> None:
        keys = fresh_keys(i, args.pages)
        reservation = index.reserve(f"r{i}", TENANT, keys)
        ram_pool.store(cache, stored, reservation.slots)
        index.commit(f"r{i}")
        ram_keys.append(keys)

    def ram_load(_: int) -> None:
        keys = ram_keys[-1]
        slots = index.pin(keys, TENANT)
        ram_pool.load(slots, cache, loaded)
        index.unpin(keys)

    record("RAM tier: put", median_seconds(ram_put, repeats))
    record("RAM tier: load", median_seconds(ram_load, repeats))
    assert all(torch.equal(layer[args.pages:], layer[:args.pages]) for layer in cache)
    ram_slots = index.pin(ram_keys[-1], TENANT)  # what a persist reads, pinned as one is

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        fs_type = file_system(root)
        plain = root / "plain.bin"

        def plain_write(_: int) -> None:
            fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, view)
                os.fsync(fd)
            finally:
                os.close(fd)

        def plain_read(_: int) -> None:
            with open(plain, "rb", buffering=0) as f:
                f.readinto(dst.numpy())

        record("plain file: write + fsync (disk ceiling)", median_seconds(plain_write, repeats))
        record("plain file: read, warm", median_seconds(plain_read, repeats))
        record(
            "plain file: read, cold",
            median_seconds(plain_read, repeats, lambda _: drop_cache([plain])),
        )

        # Room for every repeat's checkpoint: the figures are writes, not evictions.
        disk_bytes = 2 * nbytes * (repeats + 1)
        with KVCheckpointStore(root / "kv", NAMESPACE, disk_bytes) as store:
            # The worker's blobs: the same folder, in the namespace the scheduler keys in.
            worker_blobs = open_blob_root(None, root / "kv").store(store.namespace)
            staging = torch.empty_like(src)

            def persist(i: int) -> None:
                keys = fresh_keys(i, args.pages)
                store.reserve(f"c{i}", keys, TENANT)
                worker_blobs.write_many(keys, TENANT, ram_pool.read_many(ram_slots))
                store.record_written(f"c{i}", TENANT, keys, slot, "system", "{}", "{}", None)

            def load(_: int) -> None:
                keys = fresh_keys(repeats - 1, args.pages)
                n = store.longest_prefix(keys, TENANT)
                done, error = worker_blobs.read_many(keys[:n], TENANT, staging)
                assert n == done == args.pages and error is None, (n, done, error)
                store.touch(keys)

            record("disk tier: persist", median_seconds(persist, repeats))
            record("disk tier: load, warm", median_seconds(load, repeats))
            assert torch.equal(staging, src)
            blobs = [path for _, _, path in blob_files(root / "kv")]
            record(
                "disk tier: load, cold",
                median_seconds(load, repeats, lambda _: drop_cache(blobs)),
            )
            # The blobs of one checkpoint read on one thread and on the read pool's, beside a
            # prefix load's read (``read_ahead``: files read a chunk ahead while this thread opens).
            blob_store, keys = BlobStore(root / "blobs", NAMESPACE), fresh_keys(repeats, args.pages)
            blob_store.write_many(keys, TENANT, src)

            blob_seal = blob_store.keys.for_read(TENANT, NAMESPACE)  # once a prefix, as a load does

            def read_run(run: range) -> None:
                for i in run:
                    blob_store.read(keys[i], TENANT, dst[i], blob_seal)

            runs = [
                range(args.pages * k // threads, args.pages * (k + 1) // threads)
                for k in range(threads)
            ]
            record(
                "disk blobs: read, 1 thread",
                median_seconds(lambda _: read_run(range(args.pages)), repeats),
            )
            record(f"disk blobs: read, {threads} threads", median_seconds(
                lambda _: list(pool.map(read_run, runs)), repeats))
            record("disk blobs: read as a prefix load does", median_seconds(
                lambda _: blob_store.read_many(keys, TENANT, dst), repeats))
            assert torch.equal(dst, src)

    ceiling = results[0][1]
    print(
        f"{args.pages} pages x {args.slot_kib} KiB = {nbytes / 2**20:.0f} MiB per checkpoint, "
        f"median of {repeats}; disk on {fs_type}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'path':42s} {'GB/s':>8s} {'x copy':>8s}")
    for label, rate in results:
        print(f"{label:42s} {rate:8.2f} {rate / ceiling:8.2f}")


def _never() -> None:
    raise AssertionError("a blob the benchmark sealed did not open")


if __name__ == "__main__":
    main()
