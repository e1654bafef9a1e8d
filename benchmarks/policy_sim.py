"""Does choosing what to keep beat keeping everything? Admission policies side by side on a real
trace.

Replays a Mooncake-format trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512-token blocks) against a RAM tier of a given byte budget, and optionally a
disk tier, once per policy and budget, in one process:

- ``lru``: store every block of every request, evict least recently used (what vLLM's native
  offloading and LMCache do by default);
- ``arc``: store everything, ARC eviction (vLLM's offloading offers it);
- ``s3-fifo``: store everything, S3-FIFO eviction (small FIFO, main FIFO, ghost; SOSP'23);
- ``w-tinylfu``: store everything into a window; a frequency sketch admits the window's victim
  to the main segmented LRU only if it is used more often than the main victim (Caffeine's design);
- ``store-after-N``: store a block once it has been offered N times (vLLM's ``store_threshold``,
  Dynamo KVBM's "seen at least twice" disk filter);
- ``kvci``: the connector's default RAM tier, replayed with the product's code
  (``benchmarks/policysim/kvci_tier.py``): the real ``RAMIndex`` with its ``ValuePolicy``
  (``kvci_plugin.policy``), and the connector's own keep decision (``KeepDecider``: the real
  advisor, cache gate and offers), only full blocks kept;
- ``kvci-threshold``: the worthiness bar (``ram_policy: "threshold"``), the real advisor and
  cache gate scoring what a live engine knows when the request finishes (never the future);
  ``kvci-threshold@T`` is the same advisor built with a RAM threshold T;
- ``kvci-pressure``: the same advisor whose RAM threshold follows the RAM tier's pressure
  (``kvci_plugin.policy.admission.PressureAwareAdmission``): it rises with each admitted request
  evicted before a hit and falls with each held-back request that a later one extends;
- ``random``: the control, whole requests admitted blindly as often as ``kvci`` admitted;
- ``oracle``: a bound, not a policy: admits exactly the requests whose session continues;
- ``oracle-later-first-all`` / ``-none``: bounds that know the future of later turns only and
  admit every / no session's first request;
- ``belady``: the offline bound, Belady's MIN with bypass over the trace's future block uses,
  prefix-closed (``benchmarks/policysim/belady_bound.py`` says what exactly it bounds).

For every policy and budget the report gives saved tokens and bytes written against LRU, and the
share of the offline bound's gain over LRU the policy captured; per budget, the best online
baseline (the most saving of lru, arc, s3-fifo, w-tinylfu, store-after-N) and whether ``kvci``
meets the issue's per-budget targets.

The report also holds a descriptive follow-up table: how often a request's session continues, by
the first request's input and output lengths and by the turn (it reads the whole trace).

The model: a block is 512 tokens, one hash id. A request hits the longest leading run of its
hash ids resident in RAM (then on disk) and saves that many blocks of prefill. For every policy
alike a hit covers full blocks only and never the prompt's last token, and a tier holds full
blocks only, as an engine does (vLLM's block hashes cover full blocks and it always computes the
last token): an exact repeat saves its full blocks, not its whole input. Then the policy admits a
leading run of its chain to each tier; bytes written = blocks
newly written x 512 x bytes per token of the model shape. The admission policies (store-after-N,
kvci-threshold, random, the oracles) evict by the same block LRU, so for them the admission
decision is the only difference; arc, s3-fifo and w-tinylfu store everything and differ by their
eviction; ``kvci`` evicts by its own policy at checkpoint granularity, as the connector does.
Sessions (the trace has no ids) are inferred as threads: a request continues the session whose
last prompt it extends, as a client sending one session id per conversation would make them (the
connector's cache gate only ever sees the session ids clients send). ``--session-keyed`` keys
them by the first two hash ids instead, which puts every user behind a shared system prompt in
one session that "rewrites" with each request: see ``benchmarks/policysim/sessions.py``.

Get the traces from the Mooncake release (github.com/kvcache-ai/Mooncake, FAST25-release/traces);
this project never copies them. The second trace the results README shows, a slice of 1,000
requests of Mooncake's mixed production trace (many users behind shared system prompts), is
`mooncake_trace.jsonl` of github.com/hiverge/dynamo at commit 4915d8fa; it runs as is and with
`--session-keyed`. From the repository root:

    .venv/bin/python -m benchmarks.policy_sim \\
        --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --out benchmarks/results     # policy_sim_conversation.json and .png
    # benchmarks/results/README.md from the JSON files:
    .venv/bin/python -m benchmarks.render_results
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.policysim.model_shape import MODEL_SHAPES
from benchmarks.policysim.plot import plot_report
from benchmarks.policysim.report import TARGET_POLICY, Comparison, SimulationReport
from benchmarks.policysim.sweep import (
    DEFAULT_BUDGET_FRACTIONS,
    DEFAULT_MODEL,
    DEFAULT_PREFILL_TOKENS_PER_SECOND,
    SweepConfig,
    run_sweep,
)
from kvci_plugin.worthiness import DEFAULT_RAM_THRESHOLD

GIB = 1 << 30


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.policy_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--label",
        help="names the report's section and the files --out writes (default: from the trace's "
        "file name, e.g. conversation for mooncake_conversation_trace.jsonl)",
    )
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_SHAPES),
        default=DEFAULT_MODEL,
        help="KV shape: bytes per token",
    )
    parser.add_argument(
        "--budgets",
        type=_fractions,
        default=DEFAULT_BUDGET_FRACTIONS,
        help="RAM budgets as fractions of the trace's working set, comma-separated (default: "
             "%(default)s)",
    )
    parser.add_argument(
        "--disk-fraction",
        type=float,
        default=0.0,
        help="disk tier as a fraction of the working set (0: no disk tier)",
    )
    parser.add_argument(
        "--store-threshold", type=int, default=2, help="N of the store-after-N policy"
    )
    parser.add_argument(
        "--kvci-ram-threshold",
        type=float,
        action="append",
        help="the advisor's RAM threshold; repeat for several kvci policies (default: "
             f"{DEFAULT_RAM_THRESHOLD})",
    )
    parser.add_argument(
        "--prefill-tokens-per-second",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_SECOND,
        help="turns uncached tokens into the prefill time kvci observes (default: the rebuild-cost "
             "model's rate)",
    )
    parser.add_argument(
        "--session-keyed",
        action="store_true",
        help="key sessions by their leading hash ids instead of inferring them as threads "
        "(a request continues the one whose prompt it extends)",
    )
    parser.add_argument("--session-key-blocks", type=int, default=2,
                        help="with --session-keyed: leading hash ids that key a session")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random control")
    parser.add_argument(
        "--out",
        type=Path,
        help="write policy_sim_LABEL.json and policy_sim_LABEL.png in this folder",
    )
    parser.add_argument(
        "--json", type=Path, help="write the report as JSON here (instead of --out's name)"
    )
    parser.add_argument(
        "--plot", type=Path, help="write the PNG figure here (instead of --out's name)"
    )
    return parser.parse_args(argv)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"budgets must be comma-separated numbers, got {text!r}"
        ) from None


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(
        trace=args.trace,
        label=args.label,
        limit=args.limit,
        model=args.model,
        budget_fractions=tuple(args.budgets),
        disk_fraction=args.disk_fraction,
        store_threshold=args.store_threshold,
        kvci_ram_thresholds=tuple(args.kvci_ram_threshold or (DEFAULT_RAM_THRESHOLD,)),
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        session_key_blocks=args.session_key_blocks,
        session_threads=not args.session_keyed,
        seed=args.seed,
    )


def results_table(report: SimulationReport) -> Table:
    disk = report.settings.disk_fraction > 0
    table = Table(
        title=(
            f"{report.label}: {report.trace.requests} requests, working set "
            f"{report.working_set_bytes / GIB:,.0f} GiB ({report.model.name}); target: "
            f"{TARGET_POLICY} against LRU and the best online baseline"
        )
    )
    headers = [
        "budget",
        "policy",
        "saved Mtok",
        "hit",
        "RAM GiB w",
        *(["disk GiB w"] if disk else []),
        "tok/GB w",
    ]
    headers += ["saved xLRU", "LRU w/this", "bound gain", "target"]
    for header in headers:
        table.add_column(header, justify="left" if header in ("budget", "policy") else "right")
    for run in report.runs:
        comparisons = {comparison.policy: comparison for comparison in run.comparisons}
        budget = f"{run.budget_fraction:.1%} {run.ram_bytes / GIB:,.0f}G"
        for index, result in enumerate(run.policies):
            comparison = comparisons.get(result.name)
            per_gb = result.saved_tokens_per_gb_written
            name = f"[dim]{result.name}[/dim]" if result.role == "bound" else result.name
            cells = [
                budget if index == 0 else "",
                f"{name} *" if result.name == run.best_online else name,
                f"{result.saved_tokens / 1e6:.2f}",
                f"{result.token_hit_rate:.1%}",
                f"{result.ram_bytes_written / GIB:,.0f}",
                *([f"{result.disk_bytes_written / GIB:,.0f}"] if disk else []),
                "-" if per_gb is None else f"{per_gb:,.0f}",
                _times(comparison.saved_ratio) if comparison else "1",
                _times(comparison.write_reduction) if comparison else "1",
                _share(comparison.bound_share) if comparison else "0%",
                _verdict(comparison) if comparison else "",
            ]
            table.add_row(*cells)
        ceiling = [
            "",
            "[dim]never evicts[/dim]",
            *[""] * (len(headers) - 6),
            f"[dim]{_times(run.ceiling_saved_ratio)}[/dim]",
        ]
        table.add_row(*ceiling, "", "", "", end_section=True)
    table.caption = (
        "*: the best online baseline at that budget; bound gain: share of the offline bound's gain "
        "over LRU"
    )
    return table


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _verdict(comparison: Comparison) -> str:
    if comparison.target_met is None:
        return ""
    goal = f">={comparison.target_saved_ratio}x"
    if comparison.target_write_reduction is not None:
        goal += f", w>={comparison.target_write_reduction}x"
    return f"[green]met {goal}[/green]" if comparison.target_met else f"[red]missed {goal}[/red]"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(arguments)
    command = shlex.join(["python", "-m", "benchmarks.policy_sim", *arguments])
    try:
        report = run_sweep(config_from_args(args), command=command)
    except (OSError, ValueError) as exc:
        print(f"policy_sim: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(results_table(report))
    console.print(f"replayed in {report.runtime_s:.1f} s")
    stem = f"policy_sim_{report.label}"
    json_path = (
        args.json if args.json is not None or args.out is None else args.out / f"{stem}.json"
    )
    plot_path = args.plot if args.plot is not None or args.out is None else args.out / f"{stem}.png"
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_path}")
    if plot_path is not None:
        plot_report(report, plot_path)
        console.print(f"wrote {plot_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
