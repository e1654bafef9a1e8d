"""The RAM tier's scheduler-side cost and memory as the tier grows (issue #51).

kvci's RAM tier keeps its books on vLLM's scheduler thread: every microsecond it spends there
delays every request the engine serves. This drives the connector's per-request calls, in the
connector's order, on the real ``RAMIndex`` and tier policy inside the real
``TieredCheckpointManager``:

- ``on_stored`` for the previous request's store (the worker reports its copy one step later:
  the mover queues every copy, as the connector's does);
- ``longest_prefix``, then for a hit ``pin``, ``observe_lookup``, ``unpin`` (the load);
  ``observe_lookup`` alone for a miss;
- ``sight`` (the keep decision remembers the request's anchor), ``checkpoint_now`` (the system
  trigger: reserve, evictions, the recommendation kept with the checkpoint), ``policy_stats``
  when ``policy_changes`` moved (the connector's per-step poll).

The workload: 100 shared system prompts picked by Zipf popularity, sessions of many turns (each
turn re-sends the whole conversation and adds a user message and a reply), several sessions
interleaved, one tenant, a simulated clock (a request every 50 ms). Each request's keys are new
key objects, as the connector computes them anew from the request's token ids. The tier is first
filled to ``--fill`` times its pages through the same calls (untimed), then ``--requests``
requests are timed call by call. Each (size, policy) runs in a process of its own, so that its
RSS and its garbage collector's tracked objects are its own.

Every call is timed in the thread's CPU time (on a shared machine, wall time also counts the
moments the thread waited for a core; the per-request wall time is reported beside it). The
startup heap is frozen before the tier is built, as vLLM's EngineCore freezes it after its
startup (``freeze_gc_heap``), so the collector's pauses are those of what serving made.

Reported per size and policy: per-call and per-request median, p99, max, and the worst single
call; the garbage collector's pauses while timing (``gc.callbacks``: count, longest, longest
full collection, objects tracked outside the frozen startup heap); RSS per held page (the
process's resident memory grown from before the index was built to after the fill, over the
pages held); what one full collection costs at that size (``gc.collect()`` after the timed
requests: the pause the engine pays whenever one comes); and the reads an operator's tools make
(``ram_stats``, ``explain`` without a tenant, ``policy_learned``), each under the index's lock for
its whole run: after one call, the longest of five more; last, a forget of the tenant (every
checkpoint the tier holds), under the manager's lock and the index's.

    .venv/bin/python -m benchmarks.bench_scale [--pages 1e3,1e4,1e5,1e6] [--policy value,lru]
        [--requests N] [--fill F] [--seed S] [--quick] [--out benchmarks/results/scale.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report_files import reports_of
from kvci_plugin.policy import Offer
from kvci_plugin.policy.ram_policy import RAM_POLICY_NAMES, ram_policy_for
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey, Reservation
from kvci_plugin.worthiness import CheckpointAdvisor, CheckpointObservation

SCHEMA = "kvci-bench-scale/1"
RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
TENANT = "bench"
SYSTEM_PROMPTS = 100
ZIPF_S = 1.1
# Pages of a system prompt, of one turn's user message and reply, and turns per session: the
# average prompt comes out near the issue's ~470 pages.
SYSTEM_PAGES = (150, 350)
TURN_PAGES = (10, 80)
TURNS = (2, 14)
SESSIONS_AT_ONCE = 64
STEP_S = 0.05
READS = 5
CALLS = ("on_stored", "longest_prefix", "pin", "observe_lookup", "unpin", "sight",
         "checkpoint_now", "policy_stats")


class Workload:
    """Seeded requests: (prompt keys, offer) with the prompt re-sent and grown turn by turn."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        weights = [1.0 / (i + 1) ** ZIPF_S for i in range(SYSTEM_PROMPTS)]
        self._weights = weights
        self._system = [self._rng.randint(*SYSTEM_PAGES) for _ in range(SYSTEM_PROMPTS)]
        self._sessions: list[list[Any]] = [self._new() for _ in range(SESSIONS_AT_ONCE)]
        self._next_session = 0

    def _new(self) -> list[Any]:
        """A session: its keys so far (joined in one bytes: the bench's own state is no list
        the garbage collector walks, so its pauses are kvci's), its turns left, its id."""
        prompt = self._rng.choices(range(SYSTEM_PROMPTS), self._weights)[0]
        keys = b"".join((prompt << 20 | i).to_bytes(16, "big")
                        for i in range(self._system[prompt]))
        self._next_session = getattr(self, "_next_session", 0) + 1
        return [keys, self._rng.randint(*TURNS), self._next_session]

    def next(self) -> tuple[tuple[PageKey, ...], Offer]:
        i = self._rng.randrange(SESSIONS_AT_ONCE)
        keys, left, sid = self._sessions[i]
        start = len(keys) // 16
        joined = keys + b"".join(((1 << 64) | sid << 24 | j).to_bytes(16, "big")
                                 for j in range(start, start + self._rng.randint(*TURN_PAGES)))
        # New key objects, as the connector computes a request's keys anew from its token ids:
        # a checkpoint never shares its key objects with another, nor with an earlier turn.
        chain = tuple(joined[i:i + 16] for i in range(0, len(joined), 16))
        if left <= 1:
            self._sessions[i] = self._new()
        else:
            self._sessions[i][:2] = joined, left - 1
        offer = Offer(anchor=chain[-1], score=self._rng.random(),
                      rebuild_s_per_page=0.004 * self._rng.uniform(0.5, 1.5),
                      pending=None)
        return chain, offer


class _Mover:
    """The connector's mover, without bytes: every copy is queued; the bench reports it done."""

    def __init__(self) -> None:
        self.queued: list[str] = []
        self.new_pages = 0  # pages the tier has taken in, all stores together

    def store(self, reservation: Reservation, source: Any) -> bool:
        self.queued.append(reservation.checkpoint_id)
        self.new_pages += len(reservation.new_keys)
        return False

    def persist(self, *args: Any) -> bool:
        raise AssertionError("the bench persists nothing")


class GCWatch:
    """The garbage collector's pauses, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.pauses.append((info["generation"], time.thread_time() - self._start))


class Tier:
    """A manager over a RAM tier of ``pages`` pages run under ``policy``; a simulated clock."""

    def __init__(self, pages: int, policy: str) -> None:
        self.now = 1_000_000.0
        clock: Callable[[], float] = lambda: self.now  # noqa: E731 - read by the index
        tier_policy = ram_policy_for(policy).tier_policy()
        self.index = RAMIndex(num_slots=pages, slot_bytes=4096, max_entries=pages,
                              policy=tier_policy, clock=clock)
        self.mover = _Mover()
        self.manager = TieredCheckpointManager(index=self.index, mover=self.mover, clock=clock)
        self.rec = CheckpointAdvisor().recommend(
            CheckpointObservation(context_tokens=8192, output_tokens=256, tool_calls=2))
        self.changes_seen = -1

    def request(self, chain: tuple[PageKey, ...], offer: Offer,
                time_call: Callable[..., Any]) -> None:
        """One request's calls, in the connector's order; ``time_call(name, fn, *args)``."""
        self.now += STEP_S
        index, manager = self.index, self.manager
        for cid in self.mover.queued:
            time_call("on_stored", manager.on_stored, cid, True)
        self.mover.queued.clear()
        hit = time_call("longest_prefix", index.longest_prefix, chain, TENANT)
        if hit:
            time_call("pin", index.pin, chain[:hit], TENANT)
        time_call("observe_lookup", index.observe_lookup, chain)
        if hit:
            time_call("unpin", index.unpin, chain[:hit])
        time_call("sight", index.sight, offer)
        time_call("checkpoint_now", manager.checkpoint_now, tenant=TENANT, keys=chain,
                  trigger="system", recommendation=self.rec, source=None, offer=offer)
        if index.policy_changes != self.changes_seen:
            self.changes_seen = index.policy_changes
            time_call("policy_stats", index.policy_stats)


def _untimed(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, p99 and max, in microseconds."""
    s = sorted(samples)
    if not s:
        return {"n": 0, "median_us": 0.0, "p99_us": 0.0, "max_us": 0.0}
    return {"n": len(s), "median_us": round(s[len(s) // 2] * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1),
            "max_us": round(s[-1] * 1e6, 1)}


def _fill(tier: Tier, work: Workload, fill: float, pages: int) -> int:
    """Requests until the tier has taken ``fill`` times its pages in new pages; how many."""
    n = 0
    while tier.mover.new_pages < fill * pages:
        tier.request(*work.next(), _untimed)
        n += 1
    return n


def _reads(tier: Tier) -> dict[str, float]:
    """The operator-facing reads (each holds the index's lock): after one call (its first-use
    costs are not the tier's), the longest of ``READS`` more, in microseconds."""
    out = {}
    some = next(iter(tier.index.entries(TENANT)), None)
    for name, fn in (("ram_stats", tier.manager.ram_stats),
                     ("index_stats", tier.index.stats),
                     ("explain_without_tenant",
                      lambda: some and tier.manager.explain(some.checkpoint_id)),
                     ("policy_learned", tier.index.policy_learned)):
        fn()
        took = []
        for _ in range(READS):
            start = time.thread_time()
            fn()
            took.append(time.thread_time() - start)
        out[name] = round(max(took) * 1e6, 1)
    return out


def run_one(pages: int, policy: str, requests: int, fill: float, seed: int) -> dict[str, Any]:
    """One size under one policy, in this process: fill, then time ``requests`` requests."""
    work = Workload(seed)
    gc.collect()
    rss_before = _rss_bytes()
    tier = Tier(pages, policy)
    # What vLLM's EngineCore does once its startup is done (``freeze_gc_heap``): the heap of
    # imports and startup objects is frozen, so collections walk only what serving made since
    # (the scheduler's connector, kvci's tier among it, lives in that process).
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    fill_requests = _fill(tier, work, fill, pages)
    fill_s = time.perf_counter() - start
    gc.collect()
    rss_held = _rss_bytes() - rss_before
    held = tier.index.stats()
    timed = _time_requests(tier, work, requests)
    return {
        "pages": pages, "policy": policy, "requests": requests, "fill_requests": fill_requests,
        "fill_s": round(fill_s, 1), "checkpoints": held.entries, "held_pages": held.pages,
        **timed, "rss_per_held_page_b": round(rss_held / max(1, held.pages), 1),
        "reads_us": _reads(tier), "evictions": tier.index.stats().evictions,
        "forget_us": _forget(tier),
    }


def _forget(tier: Tier) -> float:
    """A forget of the tenant, which holds every checkpoint (the manager's part under its lock,
    all of it on the index's: ``forget_ram``), in microseconds. Last: it empties the tier."""
    start = time.thread_time()
    tier.manager.forget_ram(TENANT)
    return round((time.thread_time() - start) * 1e6, 1)


def _time_requests(tier: Tier, work: Workload, requests: int) -> dict[str, Any]:
    """Run ``requests`` requests, every call timed; their summaries."""
    per_call: dict[str, list[float]] = defaultdict(list)
    per_request: list[float] = []
    wall: list[float] = []
    worst = [0.0, ""]
    prompt_pages = 0

    def time_call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # The thread's CPU time: on a shared machine, wall time also counts the moments the
        # thread waited for a core, which no change to kvci moves.
        w0, t0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        took = time.thread_time() - t0
        wall[-1] += time.perf_counter() - w0
        per_call[name].append(took)
        per_request[-1] += took
        if took > worst[0]:
            worst[:] = [took, name]
        return out

    watch = GCWatch()
    gc.callbacks.append(watch)
    for _ in range(requests):
        chain, offer = work.next()
        prompt_pages += len(chain)
        per_request.append(0.0)
        wall.append(0.0)
        tier.request(chain, offer, time_call)
    gc.callbacks.remove(watch)
    return {
        "avg_prompt_pages": round(prompt_pages / max(1, requests), 1),
        "per_request": _summary(per_request), "per_request_wall": _summary(wall),
        "per_call": {name: _summary(per_call[name]) for name in CALLS if per_call[name]},
        "worst_call": {"call": worst[1], "us": round(worst[0] * 1e6, 1)},
        "gc": _gc_summary(watch),
    }


def _gc_summary(watch: GCWatch) -> dict[str, Any]:
    full = [d for g, d in watch.pauses if g == 2]
    return {"collections": len(watch.pauses),
            "longest_us": round(max((d for _, d in watch.pauses), default=0.0) * 1e6, 1),
            "full_collections": len(full),
            "longest_full_us": round(max(full, default=0.0) * 1e6, 1),
            "tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
            "full_collect_us": round(_full_collect() * 1e6, 1)}


def _full_collect() -> float:
    """Seconds of one full collection now."""
    start = time.thread_time()
    gc.collect()
    return time.thread_time() - start


def _sizes(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="1e3,1e4,1e5,1e6",
                        help="tier sizes in pages, comma-separated (1e5 and 100000 alike)")
    parser.add_argument("--policy", default="value,lru",
                        help=f"ram_policy names, comma-separated, of {', '.join(RAM_POLICY_NAMES)}"
                        " (lru is the keep-everything baseline)")
    parser.add_argument("--requests", type=int, default=3000, help="requests timed per run")
    parser.add_argument("--fill", type=float, default=1.5,
                        help="the tier takes this many times its pages in before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 200 requests timed after a fill of 1.2")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON report")
    parser.add_argument("--before", type=Path,
                        help="a report of the same command on an earlier tree, kept in this one "
                        "as its baseline (the results README puts the two side by side)")
    parser.add_argument("--before-label", default="before",
                        help="what the baseline was run on (a commit)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.requests, args.fill = 200, 1.2
    sizes, policies = _sizes(args.pages), [p for p in args.policy.split(",") if p]
    for policy in policies:
        ram_policy_for(policy)  # a bad name fails before any run
    if args.one:
        print(json.dumps(run_one(sizes[0], policies[0], args.requests, args.fill, args.seed)))
        return 0
    started = time.perf_counter()
    runs = []
    for pages in sizes:
        for policy in policies:
            cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--one", "--pages", str(pages),
                   "--policy", policy, "--requests", str(args.requests), "--fill",
                   str(args.fill), "--seed", str(args.seed)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.splitlines()[-1]))
            print(_line(runs[-1]), flush=True)
    report = {"report_format": SCHEMA, "command": "python -m benchmarks.bench_scale "
              + shlex.join(argv if argv is not None else sys.argv[1:]),
              "python": platform.python_version(), "cpus": os.cpu_count(),
              "runtime_s": round(time.perf_counter() - started, 1), "runs": runs}
    if args.before is not None:
        before = json.loads(args.before.read_text(encoding="utf-8"))
        report["before"] = {"label": args.before_label, "command": before["command"],
                            "runs": before["runs"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


def load_scales(results: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The scale reports in ``results``, by file name."""
    return reports_of(results, SCHEMA)


def scale_section(path: Path, report: dict[str, Any]) -> list[str]:
    """The results README's section of one scale report."""
    header = ["| pages | policy | checkpoints | request median / p99 / max (us) | worst call (us) "
              "| longest GC (us) | a full GC (us) | tracked objects | RSS per held page (B) "
              "| ram_stats (us) | explain, no tenant (us) | policy_learned (us) | forget (us) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines = [f"## {path.stem}", "", f"Command (from the repository root, {report['runtime_s']:.0f}"
             f" s): `{report['command']}`", "",
             f"- Python {report['python']}, {report['cpus']} CPUs, shared. Times are the "
             "calling thread's CPU time (the per-request wall time is in the JSON); GC pauses "
             "are timed while the requests were, after the startup heap was frozen as vLLM's "
             "EngineCore freezes it.", "", *header, *(_row(run) for run in report["runs"])]
    before = report.get("before")
    if before:
        lines += ["", f"Before ({before['label']}; `{before['command']}`):", "", *header,
                  *(_row(run) for run in before["runs"])]
    return lines


def _row(run: dict[str, Any]) -> str:
    req, reads, gcs = run["per_request"], run["reads_us"], run["gc"]
    return (f"| {run['pages']:,} | {run['policy']} | {run['checkpoints']:,} | "
            f"{req['median_us']:,.0f} / {req['p99_us']:,.0f} / {req['max_us']:,.0f} | "
            f"{run['worst_call']['us']:,.0f} ({run['worst_call']['call']}) | "
            f"{gcs['longest_us']:,.0f} | {_full_gc(gcs)} | {gcs['tracked_objects']:,} | "
            f"{run['rss_per_held_page_b']:,.0f} | {reads['ram_stats']:,.0f} | "
            f"{reads['explain_without_tenant']:,.0f} | {reads['policy_learned']:,.0f} | "
            f"{_forget_cell(run)} |")


def _forget_cell(run: dict[str, Any]) -> str:
    forget = run.get("forget_us")  # not measured by reports before it was
    return "-" if forget is None else f"{forget:,.0f}"


def _full_gc(gcs: dict[str, Any]) -> str:
    full = gcs.get("full_collect_us")  # not measured by reports before it was
    return "-" if full is None else f"{full:,.0f}"


def _line(run: dict[str, Any]) -> str:
    req = run["per_request"]
    return (f"{run['pages']:>8} pages {run['policy']:>6}: {run['checkpoints']} checkpoints, "
            f"request median {req['median_us']:.0f} us p99 {req['p99_us']:.0f} us "
            f"max {req['max_us']:.0f} us; worst call {run['worst_call']['call']} "
            f"{run['worst_call']['us']:.0f} us; longest GC {run['gc']['longest_us']:.0f} us; "
            f"{run['rss_per_held_page_b']:.0f} B/page; reads {run['reads_us']}")


if __name__ == "__main__":
    raise SystemExit(main())
