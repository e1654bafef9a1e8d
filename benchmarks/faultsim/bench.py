"""The fault replay's engines (``Bench``): the model, the slice, and one engine run after another
over it (a warm-up, then the measured slice at a fixed pace, a fault window on its clock), each
request driven step by step and timed, each engine shut down before the next."""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.faultsim.logs import OutputTee, key_lines, say
from benchmarks.faultsim.report import EngineRun, Sample
from benchmarks.faultsim.watchdog import EngineDied, Served, Watchdog
from benchmarks.faultsim.windows import ScheduledWindow
from benchmarks.faultsim.workload import page_bytes, select_threads
from benchmarks.policysim.trace import load_trace
from benchmarks.replaysim.workload import ENGINE_BLOCK_TOKENS, EnginePrompt, engine_prompts

DTYPE = "float32"  # this machine's CPUs have no bf16 matmul: float32 is the fast path
TENANT = "acme"
SOURCE = "doc:handbook"
SOURCES = {SOURCE: {"classification": "INTERNAL", "residency_regions": ["eu"],
                    "retention_days": 30, "mandatory_markings": []}}


def kvci_metrics(llm: Any) -> dict[str, tuple[float, bool]]:
    """vllm:kvci_* series by name and labels: (value, whether it is a counter)."""
    from vllm.v1.metrics.reader import Counter as MetricCounter

    out: dict[str, tuple[float, bool]] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvci_") and isinstance(getattr(m, "value", None), (int, float)):
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
            )
            out[m.name + (f"{{{labels}}}" if labels else "")] = (
                float(m.value),
                isinstance(m, MetricCounter),
            )
    return out


class Bench:
    """The model, the slice, and one engine run after another."""

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
            raise SystemExit(
                f"only {len(self.requests)} requests of multi-turn threads: raise --sessions-from"
            )
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
        extra = {
            **self.base_extra(name),
            "catalog_url": catalog_url,
            "blob_url": blob_url,
            "disk_region": "eu",
        }
        if self.args.timeouts is not None:
            extra["timeouts"] = self.args.timeouts
        return extra

    def kvci_params(self, prompt: EnginePrompt) -> dict[str, Any]:
        params: dict[str, Any] = {
            "tenant": TENANT,
            "session_token": self.session_token,
            "persist": True,
            "source_ids": [SOURCE],
        }
        if prompt.session_id is not None:
            params["session_id"] = prompt.session_id
        return params

    # ---- one request

    def serve(
        self, llm: Any, watchdog: Watchdog, rid: str, prompt: EnginePrompt, with_kvci: bool
    ) -> Served:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"kv_transfer_params": {"kvci": self.kvci_params(prompt)}} if with_kvci else None
        sp = SamplingParams(
            max_tokens=prompt.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra
        )
        engine = llm.llm_engine
        sent = time.perf_counter()
        ttft: float | None = None
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

    def run(self, name: str, extra: dict[str, Any] | None, window: ScheduledWindow | None = None,
            warm: Sequence[EnginePrompt] | None = None) -> EngineRun:
        """One engine over the warm-up (``warm``, default the slice's) and the measured slice;
        ``window`` (a fault run) starts on the measured slice's clock."""
        warm = self.warm if warm is None else warm
        from vllm import LLM

        mark = self.tee.mark()
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
        llm = None
        error: str | None = None
        died_at: float | None = None
        samples: list[Sample] = []
        steps: list[tuple[float, float]] = []
        warm_s = measured_s = 0.0
        engine_start_s: float | None = None
        metrics: dict[str, float] = {}
        watchdog: Watchdog | None = None
        t0: float | None = None
        try:
            llm = LLM(
                model=str(self.model),
                dtype=DTYPE,
                block_size=ENGINE_BLOCK_TOKENS,
                gpu_memory_utilization=0.2,
                max_model_len=self.max_model_len,
                num_gpu_blocks_override=self.engine_blocks,
                enable_prefix_caching=extra is not None,
                enforce_eager=True,
                seed=0,
                disable_log_stats=False,
                kv_transfer_config=kv_transfer_config,
            )
            engine_start_s = round(time.perf_counter() - started, 1)
            say(f"engine {name}: started in {engine_start_s:.1f} s")
        except Exception as exc:
            error = f"the engine did not start: {type(exc).__name__}: {exc}"[:2000]
            say(f"engine {name}: {error}")
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
            say(f"engine {name}: {len(warm)} warm-up requests in {warm_s:.1f} s")
            t0 = time.perf_counter() + 0.2
            if window is not None:
                window.start_at(t0)
            for j, prompt in enumerate(self.measured):
                wait = t0 + self.due[j] - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                served = self.serve(llm, watchdog, f"{name}-{j}", prompt, extra is not None)
                samples.append(self.sample(j, served, t0, extra is not None))
                steps += [
                    (round(start - t0, 4), round(seconds, 5)) for start, seconds in served.steps
                ]
        except EngineDied as exc:
            if error is None:
                error = str(exc)
            if t0 is not None:
                died_at = time.perf_counter() - t0
                steps += [(round(start - t0, 4), round(seconds, 5)) for start, seconds in exc.steps]
                if exc.sent is not None and len(samples) < len(self.measured):
                    samples.append(self.failed_sample(
                        len(samples), round(exc.sent - t0, 4),
                        worst_step_s=round(max((d for _, d in exc.steps), default=0.0), 5),
                        steps=len(exc.steps)))
            say(
                f"engine {name}: died "
                f"{'in the warm-up' if t0 is None else f'{died_at:.1f} s into the slice'}: "
                f"{error.splitlines()[0]}"
            )
        measured_s = 0.0 if t0 is None else time.perf_counter() - t0
        for j in range(len(samples), len(self.measured)):
            samples.append(self.failed_sample(j))
        if window is not None:
            window.abort_at_end()
        if watchdog is not None:
            watchdog.stop()
        hung = bool(watchdog and watchdog.hung)
        if llm is not None:
            if error is None:
                try:
                    metrics = {
                        series: value - before.get(series, (0.0, True))[0] if counter else value
                        for series, (value, counter) in kvci_metrics(llm).items()
                    }
                except Exception as exc:  # nothing to read
                    say(f"engine {name}: no metrics: {exc}")
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:
                say(f"engine {name}: shutdown: {type(exc).__name__}: {exc}")
            del llm
            gc.collect()
        return EngineRun(
            name=name,
            extra_config=extra,
            engine_start_s=engine_start_s,
            warm_requests=len(warm),
            warm_s=round(warm_s, 2),
            measured_s=round(measured_s, 2),
            engine_died=error is not None,
            hung=hung,
            died_at_s=None if died_at is None else round(died_at, 3),
            error=error,
            log_lines=key_lines(self.tee.since(mark)),
            kvci_metrics=metrics,
            samples=samples,
            steps=steps,
        )

    def failed_sample(self, j: int, sent_s: float | None = None, **steps: Any) -> Sample:
        """Request ``j`` of the measured slice, failed: sent at ``sent_s`` (None: never sent),
        with the steps it was in flight for (``worst_step_s``, ``steps``) if any."""
        return Sample(index=j, due_s=round(self.due[j], 4), sent_s=sent_s, ttft_s=None,
                      prompt_tokens=len(self.measured[j].token_ids), cached_tokens=0,
                      kvci_tokens=0, hit_tier=None, failed=True, **steps)

    def sample(self, j: int, served: Served, t0: float, with_kvci: bool) -> Sample:
        out = served.out
        reply = ((out.kv_transfer_params or {}).get("kvci") or {}) if with_kvci else {}
        completion = out.outputs[0] if out.outputs else None
        failed = completion is None or completion.finish_reason not in ("length", "stop")
        tokens = list(completion.token_ids) if completion is not None else []
        mismatch: bool | None = None
        if with_kvci:
            reference = self.floor_outputs.get(j)
            if reference is not None and not failed:
                mismatch = tokens != reference
        elif not failed:
            self.floor_outputs[j] = tokens
        persist = reply.get("persist")
        return Sample(
            index=j,
            due_s=round(self.due[j], 4),
            sent_s=round(served.sent - t0, 4),
            ttft_s=None if served.ttft is None else round(served.ttft, 5),
            prompt_tokens=len(self.measured[j].token_ids),
            cached_tokens=out.num_cached_tokens or 0,
            kvci_tokens=reply.get("hit_tokens") or 0,
            hit_tier=reply.get("hit_tier"),
            failed=failed,
            kvci_error=str(reply["error"])[:300] if "error" in reply else None,
            persist=persist.get("status") if isinstance(persist, dict) else None,
            mismatch=mismatch,
            worst_step_s=round(max(d for _, d in served.steps), 5),
            steps=len(served.steps),
        )
