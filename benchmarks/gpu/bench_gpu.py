"""GPU benchmark of the CUDA kernels: page transfers and prefix keys, side by side in one process.

Run on a CUDA machine by ``benchmarks/gpu/run.sh``, which first builds the extension with CUDA and
the per-page memcpy baseline. It measures:

- page transfers of a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads, head size 128, bf16) for
  16- and 32-token pages, device to host (``gather_pages``) and host to device
  (``scatter_pages``), against (a) one large pinned ``cudaMemcpyAsync`` of the same bytes, the
  practical PCIe limit, (b) one ``cudaMemcpyAsync`` per page of every layer, issued from C++ as
  vLLM's ``swap_blocks`` does, (c) torch ``index_select`` / ``index_copy_`` plus one bulk copy;
- how much a copy on a side stream overlaps a stream of bf16 matrix products;
- prefix-key throughput of the CUDA op against the C++ op.

Writes everything as JSON (``--json``) and prints tables.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvci_plugin import ops
from kvci_plugin.ops._native import kvci_ops

LAYERS = 32
KV_HEADS = 8
HEAD_SIZE = 128
KV_DTYPE = torch.bfloat16
BLOCK_SIZES = (16, 32)
LAYOUTS = ("flash_attn_nhd", "flashinfer_hnd")
TRANSFER_BYTES = {"large": 512 << 20, "small": 32 << 20}
CACHE_BYTES = 2 << 30  # per layout and block size; the pages moved are a random subset of it
REPS = 10
KEY_BLOCK_SIZE = 16
# The done-criteria of the issue, for 16-token pages: at least this share of (a), this many times
# (b).
MIN_SHARE_OF_LARGE_MEMCPY = 0.8
MIN_TIMES_PER_PAGE_MEMCPY = 2.0

Run = Callable[[], object]


@dataclass
class Transfer:
    """One set of pages to move: page views of a cache, which blocks, and a pinned pool for them."""

    layout: str
    block_size: int
    size: str
    views: list[torch.Tensor]
    blocks: torch.Tensor  # CPU int64, distinct
    pool: torch.Tensor  # pinned (n_pages, slot_bytes); slot i holds blocks[i]

    @property
    def slots(self) -> torch.Tensor:
        return torch.arange(self.pool.shape[0])

    @property
    def nbytes(self) -> int:
        return self.pool.numel()


def page_views(layout: str, block_size: int, num_blocks: int) -> list[torch.Tensor]:
    """Per-layer int8 page views of an uninitialised cache laid out as vLLM lays it out on CUDA."""
    views = []
    for _ in range(LAYERS):
        if layout == "flash_attn_nhd":
            cache = torch.empty(
                (2, num_blocks, block_size, KV_HEADS, HEAD_SIZE), dtype=KV_DTYPE, device="cuda"
            )
            views += [cache[kv].view(torch.uint8).view(num_blocks, -1) for kv in (0, 1)]
        else:
            cache = torch.empty(
                (num_blocks, 2, KV_HEADS, block_size, HEAD_SIZE), dtype=KV_DTYPE, device="cuda"
            )
            views.append(cache.view(torch.uint8).view(num_blocks, -1))
    return views


def timed_ms(run: Run, reps: int = REPS) -> float:
    """Median device time of `run` between two events on the current stream, after two warm-ups."""
    run()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(run: Run, reps: int = 5) -> float:
    """Median wall time of `run` until the whole device is idle, after one warm-up."""
    run()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kvci_copy(t: Transfer, to_host: bool) -> Run:
    slots = t.slots
    if to_host:
        return lambda: ops.gather_pages(t.views, t.blocks, t.pool, slots)
    return lambda: ops.scatter_pages(t.pool, slots, t.views, t.blocks)


def one_large_memcpy(t: Transfer, to_host: bool) -> Run:
    host = t.pool.view(-1)
    device = torch.empty_like(host, device="cuda")
    if to_host:
        return lambda: host.copy_(device, non_blocking=True)
    return lambda: device.copy_(host, non_blocking=True)


def memcpy_per_page(t: Transfer, to_host: bool, library: ctypes.CDLL) -> Run:
    # Layer by layer, page by page: the order in which vLLM's swap_blocks is called and loops.
    pages, slots, sizes = [], [], []
    at = 0
    for view in t.views:
        pages.append(view.data_ptr() + t.blocks * view.stride(0))
        slots.append(t.pool.data_ptr() + t.slots * t.pool.stride(0) + at)
        sizes.append(torch.full_like(t.blocks, view.shape[1]))
        at += view.shape[1]
    page_addresses, slot_addresses, nbytes = torch.cat(pages), torch.cat(slots), torch.cat(sizes)
    dst, src = (slot_addresses, page_addresses) if to_host else (page_addresses, slot_addresses)
    copy_each = library.kvci_bench_memcpy_each

    def run() -> None:
        status = copy_each(dst.data_ptr(), src.data_ptr(), nbytes.data_ptr(), nbytes.numel(),
                           torch.cuda.current_stream().cuda_stream)
        if status != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {status}")

    return run


def torch_indexing(t: Transfer, to_host: bool) -> Run:
    blocks = t.blocks.cuda()
    if to_host:
        return lambda: t.pool.copy_(
            torch.cat([v.index_select(0, blocks) for v in t.views], 1), non_blocking=True
        )

    def run() -> None:
        staged = t.pool.to("cuda", non_blocking=True)
        at = 0
        for view in t.views:
            view.index_copy_(0, blocks, staged[:, at : at + view.shape[1]])
            at += view.shape[1]

    return run


def measure_transfer(t: Transfer, library: ctypes.CDLL) -> list[dict]:
    rows = []
    for to_host in (True, False):
        runs = {
            "kvci": kvci_copy(t, to_host),
            "a_one_large_memcpy": one_large_memcpy(t, to_host),
            "b_memcpy_per_page": memcpy_per_page(t, to_host, library),
            "c_torch_indexing": torch_indexing(t, to_host),
        }
        ms = {name: timed_ms(run) for name, run in runs.items()}
        gbs = {name: t.nbytes / (value * 1e-3) / 1e9 for name, value in ms.items()}
        rows.append(
            {
                "layout": t.layout,
                "block_size": t.block_size,
                "size": t.size,
                "pages": t.pool.shape[0],
                "views": len(t.views),
                "bytes": t.nbytes,
                "direction": "d2h" if to_host else "h2d",
                "ms": ms,
                "gb_per_s": gbs,
                "kvci_share_of_a": gbs["kvci"] / gbs["a_one_large_memcpy"],
                "kvci_times_b": gbs["kvci"] / gbs["b_memcpy_per_page"],
                "kvci_times_c": gbs["kvci"] / gbs["c_torch_indexing"],
            }
        )
    return rows


def kvci_matches_torch(t: Transfer) -> bool:
    """The pool after the kvci gather equals the pool after the torch gather, byte for byte."""
    kvci_copy(t, True)()
    torch.cuda.synchronize()
    by_kvci = t.pool.clone()
    t.pool.zero_()
    torch_indexing(t, True)()
    torch.cuda.synchronize()
    return torch.equal(by_kvci, t.pool)


def measure_overlap(t: Transfer) -> list[dict]:
    """A copy on a side stream beside enough 8192^3 bf16 products to take about as long."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    product_ms = timed_ms(lambda: torch.matmul(a, b, out=c))
    copies = ops.PageCopyStream(torch.device("cuda"))  # the worker's own copy stream
    rows = []
    for to_host in (True, False):
        copy = kvci_copy(t, to_host)

        def copy_on_side(copy: Run = copy) -> None:
            copies.run(copy, t.nbytes)

        copy_ms = wall_ms(copy_on_side)
        products = max(1, round(copy_ms / product_ms))
        compute = repeated(lambda: torch.matmul(a, b, out=c), products)
        compute_ms = wall_ms(compute)
        both_ms = wall_ms(lambda: (copy_on_side(), compute()))  # noqa: B023
        rows.append(
            {
                "direction": "d2h" if to_host else "h2d",
                "bytes": t.nbytes,
                "matmuls": products,
                "copy_ms": copy_ms,
                "compute_ms": compute_ms,
                "both_ms": both_ms,
                # 1.0: the shorter of the two hid completely behind the longer; 0.0: they ran in
                # turn.
                "overlap": (copy_ms + compute_ms - both_ms) / min(copy_ms, compute_ms),
                "compute_slowdown": both_ms / compute_ms,
            }
        )
    return rows


def repeated(run: Run, times: int) -> Run:
    def loop() -> None:
        for _ in range(times):
            run()

    return loop


def keys_of(requests: list[torch.Tensor], subkeys: torch.Tensor) -> list[torch.Tensor]:
    return kvci_ops.prefix_block_keys_batched(requests, KEY_BLOCK_SIZE, subkeys)


def measure_keys() -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for name, lengths in (
        ("64 requests x 8192 tokens", [8192] * 64),
        ("1024 requests x 512 tokens", [512] * 1024),
        ("1 request x 131072 tokens", [131072]),
    ):
        tokens = torch.randint(
            0, 2**31 - 1, (sum(lengths),), generator=generator, dtype=torch.int32
        )
        on_cpu = list(tokens.split(lengths))
        on_gpu = list(tokens.cuda().split(lengths))
        subkeys = torch.randint(
            0, 256, (32 * len(lengths),), generator=generator, dtype=torch.uint8
        )
        identical = all(
            torch.equal(g.cpu().view(torch.int64), c.view(torch.int64))
            for g, c in zip(keys_of(on_gpu, subkeys), keys_of(on_cpu, subkeys), strict=True)
        )
        cpu_ms = wall_ms(lambda: keys_of(on_cpu, subkeys))  # noqa: B023
        gpu_ms = wall_ms(lambda: keys_of(on_gpu, subkeys))  # noqa: B023
        upload_ms = wall_ms(lambda: keys_of(list(tokens.cuda().split(lengths)), subkeys))  # noqa: B023
        rows.append(
            {
                "batch": name,
                "tokens": tokens.numel(),
                "block_size": KEY_BLOCK_SIZE,
                "identical": identical,
                "cpu_ms": cpu_ms,
                "cpu_threads": torch.get_num_threads(),
                "gpu_ms": gpu_ms,
                "gpu_with_token_upload_ms": upload_ms,
                "cpu_mtokens_per_s": tokens.numel() / cpu_ms / 1e3,
                "gpu_mtokens_per_s": tokens.numel() / gpu_ms / 1e3,
                "gpu_speedup": cpu_ms / gpu_ms,
                "gpu_with_upload_speedup": cpu_ms / upload_ms,
            }
        )
    return rows


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": props.name,
        "multiprocessors": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "cpu_threads": torch.get_num_threads(),
    }


def criteria(transfers: list[dict]) -> list[dict]:
    results = []
    for row in transfers:
        if row["block_size"] != 16 or row["size"] != "large":
            continue
        results.append(
            {
                "layout": row["layout"],
                "direction": row["direction"],
                "kvci_share_of_a": row["kvci_share_of_a"],
                "kvci_times_b": row["kvci_times_b"],
                "met": row["kvci_share_of_a"] >= MIN_SHARE_OF_LARGE_MEMCPY
                and row["kvci_times_b"] >= MIN_TIMES_PER_PAGE_MEMCPY,
            }
        )
    return results


def print_report(report: dict) -> None:
    print("\npage transfers, GB/s (median of device times)")
    print(f"{'layout':<15}{'bs':>4}{'MiB':>6}{'dir':>5}{'kvci':>8}{'(a)':>8}{'(b)':>8}{'(c)':>8}"
          f"{'kvci/(a)':>10}{'kvci/(b)':>10}{'kvci/(c)':>10}")
    for row in report["transfers"]:
        g = row["gb_per_s"]
        print(
            f"{row['layout']:<15}{row['block_size']:>4}{row['bytes'] >> 20:>6}{row['direction']:>5}"
            f"{g['kvci']:>8.1f}{g['a_one_large_memcpy']:>8.1f}{g['b_memcpy_per_page']:>8.1f}"
            f"{g['c_torch_indexing']:>8.1f}{row['kvci_share_of_a']:>10.2f}{row['kvci_times_b']:>10.2f}"
            f"{row['kvci_times_c']:>10.2f}"
        )
    print(f"kvci gather equals the torch gather byte for byte: {report['kvci_matches_torch']}")
    print("\noverlap with bf16 matrix products (kvci on a side stream)")
    for row in report["overlap"]:
        print(
            f"  {row['direction']}: copy {row['copy_ms']:.1f} ms, compute {row['compute_ms']:.1f} "
            f"ms ({row['matmuls']} products), both {row['both_ms']:.1f} ms: overlap "
            f"{row['overlap']:.2f}, compute slowed x{row['compute_slowdown']:.2f}"
        )
    print("\nprefix keys, block size 16")
    for row in report["keys"]:
        print(
            f"  {row['batch']:<28} identical={row['identical']}  C++ {row['cpu_ms']:.2f} ms "
            f"({row['cpu_threads']} threads), CUDA {row['gpu_ms']:.2f} ms "
            f"(x{row['gpu_speedup']:.1f}), with token upload {row['gpu_with_token_upload_ms']:.2f} "
            f"ms (x{row['gpu_with_upload_speedup']:.1f})"
        )
    print(f"\ndone-criteria, 16-token pages: >= {MIN_SHARE_OF_LARGE_MEMCPY:.0%} of (a) and "
          f">= {MIN_TIMES_PER_PAGE_MEMCPY:.0f}x (b)")
    for row in report["criteria"]:
        print(f"  {row['layout']:<15}{row['direction']:>5}: {row['kvci_share_of_a']:.2f} of (a), "
              f"{row['kvci_times_b']:.2f}x (b): {'met' if row['met'] else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memcpy-each-lib", type=Path, required=True,
                        help="the shared library run.sh builds from benchmarks/gpu/memcpy_each.cu")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    torch.cuda.init()  # loads torch's CUDA runtime first, so the baseline library binds to it
    library = ctypes.CDLL(str(args.memcpy_each_lib))
    library.kvci_bench_memcpy_each.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    library.kvci_bench_memcpy_each.restype = ctypes.c_int

    generator = torch.Generator().manual_seed(0)
    largest = max(TRANSFER_BYTES.values())
    pinned = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
    report: dict = {"environment": environment(), "transfers": [], "overlap": [], "keys": []}
    for layout in LAYOUTS:
        for block_size in BLOCK_SIZES:
            slot_bytes = LAYERS * 2 * block_size * KV_HEADS * HEAD_SIZE * KV_DTYPE.itemsize
            views = page_views(layout, block_size, CACHE_BYTES // slot_bytes)
            for size, nbytes in TRANSFER_BYTES.items():
                n_pages = nbytes // slot_bytes
                transfer = Transfer(
                    layout=layout,
                    block_size=block_size,
                    size=size,
                    views=views,
                    blocks=torch.randperm(views[0].shape[0], generator=generator)[:n_pages],
                    pool=pinned[: n_pages * slot_bytes].view(n_pages, slot_bytes),
                )
                report["transfers"] += measure_transfer(transfer, library)
                if (layout, block_size, size) == (LAYOUTS[0], 16, "large"):
                    report["kvci_matches_torch"] = kvci_matches_torch(transfer)
                    report["overlap"] = measure_overlap(transfer)
    report["keys"] = measure_keys()
    report["criteria"] = criteria(report["transfers"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
