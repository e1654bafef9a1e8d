"""Prefix block keys: kvci's native keys against vLLM's own block hashing, side by side.

One random 32,768-token prompt, block sizes 16 and 32. Each sample is the mean time per call
over back-to-back calls filling ``--sample-ms`` (as timeit does); samples of all methods are
interleaved round by round, so machine noise hits all of them alike:

- kvci single: ``kvci_plugin.ops.prefix_block_keys`` on an int32 tensor (the headline) and on a
  Python list (conversion included);
- kvci batched: ``prefix_block_keys_batched`` on the same tokens as 8 requests of 4,096;
- vLLM: ``hash_block_tokens`` chained block by block exactly as vLLM's request block hasher does,
  over a Python list, with its default ``sha256`` and with ``sha256_cbor``;
- ``hashlib.sha256`` over the prompt's raw int32 bytes in one call (a floor, not a prefix hash).

Prints a table (median, min, max of the samples, per call) and a last line
``ratio_vs_vllm_sha256=<x>``: vLLM sha256 median / kvci single (tensor) median at block size 16.
``--json PATH`` writes the figures. From the repository root, with the extension built:

    .venv/bin/python -m benchmarks.bench_prefix_keys [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvci_plugin import ops

try:
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
except ImportError as error:
    raise SystemExit(
        f"this benchmark compares against vLLM, which is not importable: {error}"
    ) from error

PROMPT_TOKENS = 32_768
BLOCK_SIZES = (16, 32)
BATCH_REQUESTS = 8
VOCAB = 151_936
NAMESPACE = hashlib.sha256(b"bench-namespace").digest()
SECRET = hashlib.sha256(b"bench-secret").digest()
TENANT = "bench"


def vllm_chain(hash_fn: Callable[[object], bytes], tokens: list[int], block_size: int) -> list:
    """vLLM's request block hasher, without the request: chained over full blocks."""
    init_none_hash(hash_fn)
    parent = None
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_fn, parent, tokens[start : start + block_size], None)
        hashes.append(parent)
    return hashes


def methods(tokens: list[int], block_size: int) -> dict[str, Callable[[], object]]:
    tensor = torch.tensor(tokens, dtype=torch.int32)
    raw = tensor.numpy().tobytes()
    per_request = len(tokens) // BATCH_REQUESTS
    batch = [tensor[i * per_request : (i + 1) * per_request] for i in range(BATCH_REQUESTS)]
    tenants = [TENANT] * BATCH_REQUESTS
    return {
        "kvci single (int32 tensor)": lambda: ops.prefix_block_keys(
            tensor, block_size, NAMESPACE, TENANT, SECRET
        ),
        "kvci single (Python list)": lambda: ops.prefix_block_keys(
            tokens, block_size, NAMESPACE, TENANT, SECRET
        ),
        f"kvci batched ({BATCH_REQUESTS} x {per_request})": lambda: ops.prefix_block_keys_batched(
            batch, block_size, NAMESPACE, tenants, SECRET
        ),
        "vLLM hash_block_tokens sha256": lambda: vllm_chain(sha256, tokens, block_size),
        "vLLM hash_block_tokens sha256_cbor": lambda: vllm_chain(sha256_cbor, tokens, block_size),
        "hashlib.sha256 of raw bytes, one call": lambda: hashlib.sha256(raw).digest(),
    }


def measure(
    candidates: dict[str, Callable[[], object]], rounds: int, sample_seconds: float
) -> dict[str, list[float]]:
    """Seconds per call: each sample averages back-to-back calls filling ``sample_seconds``
    (as timeit does), and the samples of all methods are interleaved round by round."""
    calls_per_sample = {}
    for name, run in candidates.items():
        run()  # warm up: imports, lazy initialisation
        start = time.perf_counter()
        run()
        calls_per_sample[name] = max(1, round(sample_seconds / (time.perf_counter() - start)))
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, run in candidates.items():
            calls = calls_per_sample[name]
            start = time.perf_counter()
            for _ in range(calls):
                run()
            seconds[name].append((time.perf_counter() - start) / calls)
    return seconds


def check_agreement(tokens: list[int], block_size: int) -> None:
    single = ops.prefix_block_keys(tokens, block_size, NAMESPACE, TENANT, SECRET)
    (batched,) = ops.prefix_block_keys_batched([tokens], block_size, NAMESPACE, [TENANT], SECRET)
    vllm = vllm_chain(sha256, tokens, block_size)
    if not torch.equal(single, batched) or single.shape[0] != len(vllm):
        raise SystemExit("kvci single and batched keys disagree, or cover other blocks than vLLM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="samples per method")
    parser.add_argument(
        "--sample-ms", type=float, default=5.0, help="back-to-back calls per sample fill this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    tokens = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    results = []
    for block_size in BLOCK_SIZES:
        check_agreement(tokens, block_size)
        seconds = measure(methods(tokens, block_size), args.rounds, args.sample_ms / 1e3)
        baseline = statistics.median(seconds["vLLM hash_block_tokens sha256"])
        for name, samples in seconds.items():
            median = statistics.median(samples)
            results.append(
                {
                    "method": name,
                    "block_size": block_size,
                    "median_ms": median * 1e3,
                    "min_ms": min(samples) * 1e3,
                    "max_ms": max(samples) * 1e3,
                    "speedup_vs_vllm_sha256": baseline / median,
                }
            )

    print(
        f"prefix keys over {PROMPT_TOKENS} random tokens: {args.rounds} interleaved samples of "
        f">= {args.sample_ms} ms per method, times per call"
    )
    header = (
        f"{'method':<40} {'bs':>3} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'vs vLLM':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in results:
        print(
            f"{row['method']:<40} {row['block_size']:>3} {row['median_ms']:>10.4f} "
            f"{row['min_ms']:>9.4f} {row['max_ms']:>9.4f} {row['speedup_vs_vllm_sha256']:>8.1f}x"
        )
    headline = next(
        row["speedup_vs_vllm_sha256"]
        for row in results
        if row["block_size"] == 16 and row["method"] == "kvci single (int32 tensor)"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "prompt_tokens": PROMPT_TOKENS,
                    "rounds": args.rounds,
                    "sample_ms": args.sample_ms,
                    "results": results,
                    "ratio_vs_vllm_sha256": headline,
                },
                indent=2,
            )
        )
    print(f"ratio_vs_vllm_sha256={headline:.1f}")


if __name__ == "__main__":
    main()
