"""``vllm bench serve`` (vLLM's own benchmark client) on a slice of an agent trace, against vLLM
alone and vLLM with kvci, side by side.

The slice (``benchmarks.benchserve.trace``): the first ``--sessions`` sessions of a Mooncake-format
agent trace (``../shared/traces/agentic_coding_dev.jsonl``), their first ``--turns`` requests
sent within ``--duration`` replayed seconds, written as vLLM's ``timed_trace`` dataset: each
512-token trace block becomes ``--block-tokens`` tokens (32 on the project's tiny model, 512 - no
scaling - on a real one), timestamps start at 0 and run ``--time-scale`` times faster, outputs
capped at ``--max-output-tokens``. vLLM's client
sends each request at its time, open loop, with pre-tokenized prompts that share a prefix exactly
where the trace's block chains do.

Two OpenAI servers (``python -m vllm.entrypoints.openai.api_server``) run one after another on
``--port`` (or are given with ``--vllm-url`` / ``--kvci-url`` and left running): ``vllm``, vLLM
alone, and ``kvci``, the same arguments plus ``--kv-transfer-config`` for kvci's connector
(``--kvci-config``: keys of ``kv_connector_extra_config`` over the defaults, or a whole
``kv_transfer_config`` when it names ``kv_connector``). Each gets ``vllm bench serve
--dataset-name timed_trace --save-result --save-detailed``; the report keeps its summary, the
TTFT of every request classed by how the session's previous turn ended (``tool_return``: after a
tool call, the agent's turn kvci is for), and the server's prompt-token counters from ``/metrics``
(vLLM's prefix-cache hits, the connector's hits). Requests carry no ``kv_transfer_params``: kvci
works as it does for a client that says nothing.

On this machine (no ``--model``): the tiny random-weight model (``kvci_plugin.tinymodel``,
float32), 32-token blocks, and vLLM's KV cache held to ``--engine-blocks`` (default: the slice's
longest request and one block, as ``benchmarks/replay.py`` holds it) so that paused sessions do
not stay in it; kvci's RAM tier holds the slice's distinct blocks. On a GPU, for example::

    python -m benchmarks.bench_serve --model meta-llama/Llama-3.1-8B-Instruct \\
        --sessions 16 --time-scale 2 --duration 900 --max-input-tokens 120000 \\
        --kvci-config '{"ram_bytes": "64GiB"}' --label h100 \\
        --server-args "--max-model-len 131072 --gpu-memory-utilization 0.9"

writes ``benchmarks/results/bench_serve_<label>.json`` (``--out`` names another file);
``python -m benchmarks.render_results`` turns it into the results README.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.benchserve.report import SCHEMA, comparison, run_summary
from benchmarks.benchserve.trace import (
    SEC_MULTIPLIER,
    TimedRow,
    read_agent_trace,
    select_sessions,
    to_timed_trace,
    within,
    write_timed_trace,
)
from benchmarks.policysim.trace import BLOCK_TOKENS

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "agentic_coding_dev.jsonl"
RUNS = ("vllm", "kvci")
TINY_BLOCK_TOKENS = 32  # vLLM on CPU needs a multiple of 32
# Counters read from each server's /metrics before and after its run (summed over labels).
METRICS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
           "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
           "vllm:external_prefix_cache_hits_total", "vllm:kvci_hit_tokens_total",
           "vllm:kvci_checkpoints_total", "vllm:kvci_evicted_checkpoints_total",
           "vllm:num_preemptions_total")


def _say(message: str) -> None:
    print(f"[bench_serve] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model name or folder (default: the tiny model, generated)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format agent trace")
    p.add_argument("--sessions", type=int, default=6, help="sessions of the slice (default 6)")
    p.add_argument("--skip-sessions", type=int, default=0, help="sessions skipped before them")
    p.add_argument("--turns", type=int, help="requests per session at most (default: all)")
    p.add_argument("--duration", type=float, default=120.0,
                   help="replayed seconds: later requests are left out (default 120; 0: none)")
    p.add_argument("--max-input-tokens", type=int,
                   help="trace tokens: a session is cut before a longer request (tiny model: "
                        "what fits its context)")
    p.add_argument("--block-tokens", type=int,
                   help=f"tokens per 512-token trace block (tiny model {TINY_BLOCK_TOKENS}, "
                        f"else {BLOCK_TOKENS})")
    p.add_argument("--time-scale", type=float, default=10.0,
                   help="trace seconds per replayed second (default 10)")
    p.add_argument("--max-output-tokens", type=int,
                   help="cap on each output (tiny model: 32; else the trace's)")
    p.add_argument("--port", type=int, default=8100,
                   help="port of the servers started here, one after the other (default 8100)")
    p.add_argument("--vllm-url", help="a running vLLM server to use instead of starting one")
    p.add_argument("--kvci-url", help="a running vLLM+kvci server to use instead of starting one")
    p.add_argument("--kvci-config", type=json.loads, default={},
                   help="JSON: kv_connector_extra_config keys over the defaults, or a whole "
                        "kv_transfer_config (one that names kv_connector)")
    p.add_argument("--server-args", default="",
                   help="more arguments for both servers (one string, shell-quoted)")
    p.add_argument("--engine-blocks", type=int,
                   help="--num-gpu-blocks-override of both servers (tiny model default: the "
                        "slice's longest request and one block)")
    p.add_argument("--bench-args", default="", help="more arguments for vllm bench serve")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take")
    p.add_argument("--label", help="names the report (default: cpu with the tiny model, else gpu)")
    p.add_argument("--out", type=Path, help="report (default benchmarks/results/"
                                            "bench_serve_<label>.json)")
    p.add_argument("--workdir", type=Path, help="keeps the dataset, the raw results and the "
                                                "server logs (default: a temporary folder)")
    args = p.parse_args(argv)
    tiny = args.model is None
    if args.block_tokens is None:
        args.block_tokens = TINY_BLOCK_TOKENS if tiny else BLOCK_TOKENS
    if args.max_output_tokens is None and tiny:
        args.max_output_tokens = 32
    if args.label is None:
        args.label = "cpu" if tiny else "gpu"
    if args.out is None:
        args.out = RESULTS_DIR / f"bench_serve_{args.label}.json"
    return args


class Model:
    """The model both servers serve, and what sizing the tiny one needs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tiny = args.model is None
        if self.tiny:
            from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

            self.spec = TinyModelSpec(dtype="float32")
            self.name = str(make_tiny_model(self.spec))
            self.max_model_len = self.spec.max_position_embeddings
        else:
            self.name = args.model

    def page_bytes(self, block_tokens: int) -> int:
        spec = self.spec
        return spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * 4 * block_tokens


def build_slice(args: argparse.Namespace, model: Model) -> list[TimedRow]:
    max_input = args.max_input_tokens
    if max_input is None and model.tiny:
        room = model.max_model_len - (args.max_output_tokens or 0)
        max_input = room // args.block_tokens * BLOCK_TOKENS
    requests = select_sessions(read_agent_trace(args.trace), args.sessions, args.turns,
                               max_input, args.skip_sessions)
    rows = to_timed_trace(requests, args.block_tokens, args.time_scale, args.max_output_tokens)
    return within(rows, args.duration or None)


def server_args(args: argparse.Namespace, model: Model, rows: Sequence[TimedRow]) -> list[str]:
    """The arguments both servers share (the port and the connector aside)."""
    out = ["--model", model.name, "--seed", "0", "--enable-prefix-caching"]
    if model.tiny:
        longest = max(r.input_length + r.output_length for r in rows)
        max_model_len = -(-longest // args.block_tokens) * args.block_tokens
        blocks = args.engine_blocks or max_model_len // args.block_tokens + 1
        out += ["--dtype", "float32", "--block-size", str(args.block_tokens),
                "--max-model-len", str(max_model_len), "--enforce-eager",
                "--num-gpu-blocks-override", str(blocks)]
    elif args.engine_blocks:
        out += ["--num-gpu-blocks-override", str(args.engine_blocks)]
    return out + shlex.split(args.server_args)


def kv_transfer_config(args: argparse.Namespace, model: Model, rows: Sequence[TimedRow],
                       workdir: Path) -> dict[str, Any]:
    if "kv_connector" in args.kvci_config:
        return args.kvci_config
    if model.tiny:  # room for every distinct block of the slice
        distinct = len({h for r in rows for h in r.hash_ids})
        ram_bytes: Any = distinct * model.page_bytes(args.block_tokens)
    else:
        ram_bytes = "8GiB"
    extra = {"ram_bytes": ram_bytes, "state_dir": str(workdir / "kvci-state"), **args.kvci_config}
    return {"kv_connector": "KVCheckpointConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


class Server:
    """One OpenAI server started here (its own process group), or one given by URL."""

    def __init__(self, name: str, url: str | None, argv: list[str] | None, log: Path,
                 env: dict[str, str]) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.url = url
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        if self.argv is not None:
            env = {**os.environ, **self.env}
            with self.log.open("wb") as log:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True, cwd=REPO_ROOT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 600.0) -> None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"server {self.name} exited ({self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        _say(f"server {self.name} ready in {time.monotonic() - started:.0f} s")
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise SystemExit(f"server {self.name} not ready after {timeout:.0f} s ({self.url})")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as reply:
            return parse_metrics(reply.read().decode())

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def server_env(model: Model) -> dict[str, str]:
    """The vLLM CPU settings the servers started here run with. On this machine: a 1 GiB KV
    cache space, and one core reserved for vLLM's scheduler in both servers (vLLM reserves one
    more for any engine with a kv_transfer_config, which on 2 cores leaves it none reserved, and
    so the two servers would not run alike)."""
    env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU")
           if k in os.environ}
    if model.tiny:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


def source_state() -> dict[str, Any]:
    """The commit kvci ran from, and its package's files changed from it (the servers import
    the working tree)."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", "kvci_plugin", "csrc").splitlines()
    return {"commit": git("rev-parse", "HEAD")[:12] or None, "changed_files": len(changed)}


def parse_metrics(text: str) -> dict[str, float]:
    """``METRICS`` from a Prometheus text page, each summed over its labels."""
    sums = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def bench_argv(args: argparse.Namespace, model: Model, url: str, dataset: Path, rows: int,
               result_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.benchserve.client",
            "--backend", "vllm", "--base-url", url, "--model", model.name,
            "--dataset-name", "timed_trace", "--dataset-path", str(dataset),
            "--timed-trace-chunk-hash-size", str(args.block_tokens),
            "--timed-trace-sec-multiplier", str(SEC_MULTIPLIER), "--num-prompts", str(rows),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", f"{name}.json", "--label", name, "--disable-tqdm",
            *shlex.split(args.bench_args)]


def run_one(name: str, server: Server, argv: list[str], result: Path,
            rows: Sequence[TimedRow]) -> dict[str, Any]:
    before = server.metrics()
    # timed_trace seeds each block's tokens with Python's hash() of a string: a fixed
    # PYTHONHASHSEED gives both runs the same prompts.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (result.parent / f"{name}.client.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve against {name} failed ({done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    after = server.metrics()
    raw = json.loads(result.read_text(encoding="utf-8"))
    _say(f"{name}: {raw['completed']} completed, {raw['failed']} failed in "
         f"{raw['duration']:.1f} s; TTFT p50 {raw['p50_ttft_ms']:.0f} ms")
    counters = {key: after[key] - before[key] for key in METRICS}
    return run_summary(raw, rows, counters, wall)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    model = Model(args)
    rows = build_slice(args, model)
    sessions = list(dict.fromkeys(r.session for r in rows))
    _say(f"slice: {len(rows)} requests of {len(sessions)} sessions over "
         f"{rows[-1].timestamp_ms / 1000:.0f} s (trace time / {args.time_scale:g})")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvci-bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    dataset = workdir / "timed_trace.jsonl"
    write_timed_trace(rows, dataset)
    shared = server_args(args, model, rows)
    kvci_config = kv_transfer_config(args, model, rows, workdir)
    given = {"vllm": args.vllm_url, "kvci": args.kvci_url}
    env = server_env(model)
    servers: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    for name in RUNS:
        url = given[name] or f"http://127.0.0.1:{args.port}"
        argv_ = None
        if given[name] is None:
            argv_ = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--host", "127.0.0.1", "--port", str(args.port), *shared]
            if name == "kvci":
                argv_ += ["--kv-transfer-config", json.dumps(kvci_config)]
        servers[name] = {"url": None if argv_ else url,
                         "argv": [Path(argv_[0]).name, *argv_[1:]] if argv_ else None}
        bench = bench_argv(args, model, url, dataset, len(rows), workdir, name)
        # as the vllm console script takes it (benchmarks.benchserve.client runs the same)
        servers[name]["bench_argv"] = ["vllm", "bench", "serve", *bench[3:]]
        with Server(name, url, argv_, workdir / f"{name}.server.log", env) as server:
            runs[name] = run_one(name, server, bench, workdir / f"{name}.json", rows)
    from vllm import __version__ as vllm_version

    trace_bytes = args.trace.read_bytes()
    report = {
        "report_format": SCHEMA,
        "command": " ".join(["python -m benchmarks.bench_serve",
                             shlex.join(argv if argv is not None else sys.argv[1:])]).strip(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "vllm_version": vllm_version, "cpus": os.cpu_count(),
        "load_average": [load_start, os.getloadavg()[0]],
        "env": env,
        "model": {"name": "tiny" if model.tiny else model.name, "tiny": model.tiny},
        "kvci_source": source_state(),
        "trace": {"file": args.trace.name,
                  "sha256": hashlib.sha256(trace_bytes).hexdigest()[:16],
                  "sessions": sessions, "requests": len(rows),
                  "span_s": rows[-1].timestamp_ms / 1000.0,
                  "block_tokens": args.block_tokens, "time_scale": args.time_scale,
                  "max_output_tokens": args.max_output_tokens,
                  "distinct_blocks": len({h for r in rows for h in r.hash_ids}),
                  "prompt_tokens": sum(r.input_length for r in rows)},
        # a server given by URL runs whatever config it was started with
        "kv_transfer_config": kvci_config if args.kvci_url is None else {},
        "servers": servers, "runs": runs,
    }
    report["comparison"] = comparison(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    _say(f"wrote {args.out} (raw results and logs in {workdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
