"""Agent sessions through vLLM's OpenAI server with a tool-call parser, the tiny model emitting its
tool-call marker on ``tool_use`` turns: TTFT per turn and saved tokens for vLLM alone, kvci
keeping everything, kvci's default (automatic retention of tool-call turns), and vLLM with a
cache big enough to hold every session (the "engine holds it" reference).

The slice (``benchmarks.agentreplay.turns``): the first ``--sessions`` sessions of the agent trace
(``../shared/traces/agentic_coding_dev.jsonl``), a 512-token trace block as ``--block-tokens``
(32) tokens as ``benchmarks/replay.py`` and ``benchmarks/bench_serve.py`` scale them, timestamps
from 0 and ``--time-scale`` times faster, the requests of the first ``--duration`` replayed
seconds, outputs capped at ``--max-output-tokens`` (a forced tool call gets the room it needs).
Each request is a streamed chat completion; ``tool_use`` turns are forced to write
``<tool_call>{...}</tool_call>`` (a structured-output regex and a +100 logit bias on the
``<tool_call>`` token), every other turn is barred from the marker (-100). Each request names its
session to kvci (``kv_transfer_params.kvci.session_id``, as a client names its conversation;
``--no-session-ids``: not) and says nothing of tool calls. Each session sends its turns in
order, each at its trace time but never before its previous turn finished (an agent waits for
its answer); sessions run side by side.

The model: the tiny random-weight model with tool-call tokens (``TinyModelSpec(tool_calls=True)``:
``<tool_call>`` / ``</tool_call>`` special tokens and a Hermes-style chat template), float32,
served with ``--enable-auto-tool-choice --tool-call-parser hermes``. Four servers, one after
the other, the same requests:

- ``vllm``: vLLM alone, its KV cache held to ``--engine-blocks`` (default: the slice's longest
  request and one block, as ``benchmarks/replay.py`` holds it): paused sessions do not stay;
- ``kvci_keep_all``: the same, with kvci keeping everything and retaining nothing
  (``ram_policy: "lru"``, ``max_retain_s: 0``: a store-everything LRU tier, as vLLM's native
  offloading runs);
- ``kvci``: the same, with kvci's defaults (automatic retention of tool-call turns on);
- ``engine_holds``: vLLM alone with a cache of every distinct block of the slice and more: the
  tool-return TTFT when the engine's own cache still holds the context.

kvci's RAM tier holds every distinct block of the slice (the report's ``kvci_ram_bytes``),
unless ``--extra '{"ram_bytes": N}'`` sets a tighter one for both kvci arms. The report gives
per arm TTFT p50/p90 of tool-return turns (after a ``tool_use`` turn) and of all turns, the
prompt tokens served from cache (``usage.prompt_tokens_details.cached_tokens``, both vLLM's
prefix cache and kvci's) and the server's counters (vLLM's prefix-cache and connector hits,
kvci's ``vllm:kvci_*``), and whether each arm's outputs (token ids, finish reason) equal vLLM
alone's, request by request.

    .venv/bin/python -m benchmarks.agent_replay [--sessions 6] [--duration 90] [--time-scale 10]
        [--arms vllm,kvci_keep_all,kvci,engine_holds] [--out PATH] [--workdir DIR]

Writes ``benchmarks/results/agent_replay_cpu.json``; ``python -m benchmarks.render_results`` puts
it in the results README.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.agentreplay.report import SCHEMA, arm_summary, comparison
from benchmarks.agentreplay.turns import Turn, by_session, chat_body, slice_turns
from benchmarks.bench_serve import Server, source_state
from benchmarks.benchserve.trace import read_agent_trace, select_sessions
from benchmarks.policysim.trace import BLOCK_TOKENS

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "agentic_coding_dev.jsonl"
ARMS = ("vllm", "kvci_keep_all", "kvci", "engine_holds")
KEEP_ALL_EXTRA: dict[str, Any] = {"ram_policy": "lru", "max_retain_s": 0.0}
DTYPE = "float32"
COUNTER_PREFIXES = ("vllm:kvci_",)
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total", "vllm:num_preemptions_total")


def _say(message: str) -> None:
    print(f"[agent_replay] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agent_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--sessions", type=int, default=6, help="sessions of the slice (default 6)")
    p.add_argument("--skip-sessions", type=int, default=0)
    p.add_argument("--turns", type=int, help="requests per session at most (default: all)")
    p.add_argument("--duration", type=float, default=90.0,
                   help="replayed seconds: later requests are left out (default 90)")
    p.add_argument("--time-scale", type=float, default=10.0,
                   help="trace seconds per replayed second (default 10)")
    p.add_argument("--block-tokens", type=int, default=32)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--engine-blocks", type=int,
                   help="vLLM's KV cache of the pressured arms (default: longest request + 1)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}")
    p.add_argument("--port", type=int, default=8110)
    p.add_argument("--extra", type=json.loads, default={},
                   help="JSON: more kv_connector_extra_config keys for both kvci arms")
    p.add_argument("--server-args", default="", help="more arguments for every server")
    p.add_argument("--no-session-ids", dest="session_ids", action="store_false",
                   help="requests do not name their session to kvci (no automatic retention)")
    p.add_argument("--label", default="cpu")
    p.add_argument("--out", type=Path)
    p.add_argument("--workdir", type=Path)
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}")
    if args.out is None:
        args.out = RESULTS_DIR / f"agent_replay_{args.label}.json"
    return args


class Model:
    def __init__(self) -> None:
        from transformers import AutoTokenizer

        from kvci_plugin.tinymodel import TOOL_CALL_TOKENS, TinyModelSpec, make_tiny_model

        self.spec = TinyModelSpec(dtype=DTYPE, tool_calls=True)
        self.path = str(make_tiny_model(self.spec))
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.marker_id = self.tokenizer.convert_tokens_to_ids(TOOL_CALL_TOKENS[0])

    def page_bytes(self, block_tokens: int) -> int:
        s = self.spec
        return s.num_layers * s.num_kv_heads * s.head_dim * 2 * 4 * block_tokens

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        text = self.tokenizer.apply_chat_template(body["messages"], tools=body["tools"],
                                                  tokenize=False, add_generation_prompt=True)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def send(url: str, body: dict[str, Any], t0: float) -> dict[str, Any]:
    """One streamed chat completion: TTFT (the first chunk: vLLM sends it with the first token),
    end-to-end time, output ids, the tool call, finish reason and usage."""
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    sent = time.perf_counter()
    first = None
    token_ids: list[int] = []
    content: list[str] = []
    calls: list[str] = []
    finish = None
    usage: dict[str, Any] = {}
    error = ""
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if first is None:
                    first = time.perf_counter()
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    token_ids += choice.get("token_ids") or []
                    delta = choice.get("delta") or {}
                    content.append(delta.get("content") or "")
                    for call in delta.get("tool_calls") or []:
                        fn = call.get("function") or {}
                        calls.append((fn.get("name") or "") + (fn.get("arguments") or ""))
                    finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as exc:
        error = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}"
    except Exception as exc:  # noqa: BLE001 - recorded as the request's error
        error = f"{type(exc).__name__}: {exc}"
    done = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {"sent_s": round(sent - t0, 3),
            "ttft_ms": None if first is None or error else round((first - sent) * 1000, 3),
            "e2e_ms": round((done - sent) * 1000, 3), "token_ids": token_ids,
            "content": "".join(content), "tool_call": "".join(calls), "finish_reason": finish,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "error": error}


def replay(url: str, turns: Sequence[Turn], bodies: Sequence[dict[str, Any]]) -> list[Any]:
    """Every session on its own thread, each turn at its time and after its previous one."""
    results: list[Any] = [None] * len(turns)
    t0 = time.perf_counter()

    def session(indices: list[int]) -> None:
        for i in indices:
            wait = turns[i].row.timestamp_ms / 1000.0 - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            results[i] = send(url, bodies[i], t0)

    threads = [threading.Thread(target=session, args=(indices,), daemon=True)
               for indices in by_session(turns).values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    sums: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS or (name.startswith(COUNTER_PREFIXES) and name.endswith("_total")):
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def warm_up(url: str, model: Model, args: argparse.Namespace) -> None:
    """A forced and a free turn on a short prompt unrelated to the slice (compiles the grammar
    path), kvci told to keep none of it."""
    from benchmarks.benchserve.trace import TimedRow

    for stop in ("tool_use", "end_turn"):
        row = TimedRow(0.0, args.block_tokens + 3, 4, (-1, -2), "warmup", 0, "first", 0)
        body = chat_body(Turn(row, stop), model.path, args.block_tokens, model.marker_id)
        body["kv_transfer_params"] = {"kvci": {"checkpoint": "never"}}
        send(url, body, time.perf_counter())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    model = Model()
    room = model.spec.max_position_embeddings - 256
    max_input = room // args.block_tokens * BLOCK_TOKENS
    requests = select_sessions(read_agent_trace(args.trace), args.sessions, args.turns,
                               max_input, args.skip_sessions)
    turns = slice_turns(requests, args.block_tokens, args.time_scale, args.max_output_tokens,
                        args.duration or None)
    bodies = [chat_body(t, model.path, args.block_tokens, model.marker_id, args.session_ids)
              for t in turns]
    prompt_tokens = [model.prompt_tokens(b) for b in bodies]
    longest = max(n + b["max_tokens"] for n, b in zip(prompt_tokens, bodies))
    max_model_len = -(-longest // args.block_tokens) * args.block_tokens
    small = args.engine_blocks or max_model_len // args.block_tokens + 1
    distinct = len({h for t in turns for h in t.row.hash_ids})
    sessions = list(dict.fromkeys(t.row.session for t in turns))
    # every distinct block, a partial and an output block per request, and a request's worth
    large = distinct + 2 * len(turns) + small
    ram_bytes = (distinct + 4 * len(sessions)) * model.page_bytes(args.block_tokens)
    _say(f"slice: {len(turns)} requests of {len(sessions)} sessions over "
         f"{turns[-1].row.timestamp_ms / 1000:.0f} s; {distinct} distinct blocks; longest "
         f"{longest} tokens; engine blocks {small} (engine_holds {large})")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvci-agent-replay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
    url = f"http://127.0.0.1:{args.port}"
    shared = ["--model", model.path, "--seed", "0", "--enable-prefix-caching",
              "--dtype", DTYPE, "--block-size", str(args.block_tokens),
              "--max-model-len", str(max_model_len), "--enforce-eager",
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--enable-prompt-tokens-details", *shlex.split(args.server_args)]
    servers: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    for name in args.arms:
        argv_ = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host",
                 "127.0.0.1", "--port", str(args.port), *shared, "--num-gpu-blocks-override",
                 str(large if name == "engine_holds" else small)]
        if name.startswith("kvci"):
            extra = {"ram_bytes": ram_bytes, "state_dir": str(workdir / f"{name}-state"),
                     **args.extra, **(KEEP_ALL_EXTRA if name == "kvci_keep_all" else {})}
            argv_ += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KVCheckpointConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})]
        servers[name] = {"argv": [Path(argv_[0]).name, *argv_[1:]]}
        with Server(name, url, argv_, workdir / f"{name}.server.log", env) as server:
            warm_up(url, model, args)
            before = counters(url)
            t = time.perf_counter()
            results = replay(server.url, turns, bodies)
            wall = time.perf_counter() - t
            after = counters(url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        runs[name] = arm_summary(turns, results, delta, wall)
        s = runs[name]
        _say(f"{name}: {wall:.0f} s, TTFT p50 {s['ttft']['all']['p50_ms']} ms, tool_return p90 "
             f"{s['ttft']['tool_return']['p90_ms']} ms, errors {s['errors']}")
        (workdir / f"{name}.results.json").write_text(json.dumps(results))
    from vllm import __version__ as vllm_version

    report = {
        "report_format": SCHEMA,
        "command": " ".join(["python -m benchmarks.agent_replay",
                             shlex.join(argv if argv is not None else sys.argv[1:])]).strip(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "vllm_version": vllm_version, "cpus": os.cpu_count(),
        "load_average": [load_start, os.getloadavg()[0]], "env": env,
        "model": {"spec": model.spec.slug(), "tool_call_token_id": model.marker_id},
        "kvci_source": source_state(),
        "trace": {"file": args.trace.name,
                  "sha256": hashlib.sha256(args.trace.read_bytes()).hexdigest()[:16],
                  "sessions": sessions, "requests": len(turns),
                  "tool_use_turns": sum(t.forced_tool_call for t in turns),
                  "span_s": turns[-1].row.timestamp_ms / 1000.0,
                  "block_tokens": args.block_tokens, "time_scale": args.time_scale,
                  "max_output_tokens": args.max_output_tokens, "distinct_blocks": distinct,
                  "prompt_tokens": sum(prompt_tokens)},
        "engine_blocks": {"pressured": small, "engine_holds": large},
        "kvci_ram_bytes": ram_bytes, "extra": args.extra, "session_ids": args.session_ids,
        "servers": servers, "runs": runs,
    }
    report["comparison"] = comparison(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    _say(f"wrote {args.out} (logs and raw results in {workdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
