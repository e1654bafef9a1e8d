"""Does choosing what to keep beat keeping everything? Admission policies side by side on a real trace.

Replays a Mooncake-format trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512-token blocks) against a RAM tier of a given byte budget, and optionally a
disk tier, once per policy and budget, in one process:

- ``lru``: store every block of every request, evict least recently used (what vLLM's native
  offloading and LMCache do by default);
- ``arc``: store everything, ARC eviction (vLLM's offloading offers it);
- ``store-after-N``: store a block once it has been offered N times (vLLM's ``store_threshold``,
  Dynamo KVBM's "seen at least twice" disk filter);
- ``kvci``: the connector's default RAM tier, replayed with the product's code
  (``benchmarks/policysim/kvci_tier.py``): the real ``RAMIndex`` with its ``ValuePolicy``
  (``kvci_plugin.policy``), the real advisor and cache gate, offers built as the connector
  builds them, only full blocks kept;
- ``kvci-threshold``: the worthiness bar (``ram_policy: "threshold"``), the real advisor and
  cache gate scoring what a live engine knows when the request finishes (never the future);
  ``kvci-threshold@T`` is the same advisor built with a RAM threshold T;
- ``kvci-pressure``: the same advisor whose RAM threshold follows the RAM tier's pressure
  (``kvci_plugin.tiering.admission.PressureAwareAdmission``): it rises with each admitted request
  evicted before a hit and falls with each held-back request that a later one extends;
- ``random``: the control, whole requests admitted blindly as often as ``kvci`` admitted;
- ``oracle``: a bound, not a policy: admits exactly the requests whose session continues;
- ``oracle-later-first-all`` / ``-none``: bounds that know the future of later turns only and
  admit every / no session's first request.

The report also holds a descriptive follow-up table: how often a request's session continues, by
the first request's input and output lengths and by the turn (it reads the whole trace).

The model: a block is 512 tokens, one hash id. A request hits the longest leading run of its
hash ids resident in RAM (then on disk); it saves that many blocks of prefill, capped at its input
length. Then the policy admits a leading run of its chain to each tier; bytes written = blocks
newly written x 512 x bytes per token of the model shape. Every policy but ``arc`` evicts by the
same block LRU, so the admission decision is the only difference; ``kvci`` evicts by its own
policy at checkpoint granularity, as the connector does. Sessions (the trace has no ids)
are inferred from the first two hash ids: see ``benchmarks/policysim/sessions.py``.

Get the traces from the Mooncake release (github.com/kvcache-ai/Mooncake, FAST25-release/traces);
this project never copies them. From the repository root:

    .venv/bin/python -m benchmarks.policy_sim --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --json benchmarks/results/policy_sim_conversation.json --plot benchmarks/results/policy_sim_conversation.png
    .venv/bin/python -m benchmarks.render_results    # benchmarks/results/README.md from the JSON files
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
from benchmarks.policysim.report import TARGET_SAVED_RATIO, TARGET_WRITE_REDUCTION, SimulationReport
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
        prog="python -m benchmarks.policy_sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default=DEFAULT_MODEL, help="KV shape: bytes per token")
    parser.add_argument(
        "--budgets",
        type=_fractions,
        default=DEFAULT_BUDGET_FRACTIONS,
        help="RAM budgets as fractions of the trace's working set, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--disk-fraction", type=float, default=0.0, help="disk tier as a fraction of the working set (0: no disk tier)"
    )
    parser.add_argument("--store-threshold", type=int, default=2, help="N of the store-after-N policy")
    parser.add_argument(
        "--kvci-ram-threshold",
        type=float,
        action="append",
        help=f"the advisor's RAM threshold; repeat for several kvci policies (default: {DEFAULT_RAM_THRESHOLD})",
    )
    parser.add_argument(
        "--prefill-tokens-per-second",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_SECOND,
        help="turns uncached tokens into the prefill time kvci observes (default: the rebuild-cost model's rate)",
    )
    parser.add_argument("--session-key-blocks", type=int, default=2, help="leading hash ids that key a session")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random control")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, help="write the PNG figure here")
    return parser.parse_args(argv)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be comma-separated numbers, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(
        trace=args.trace,
        limit=args.limit,
        model=args.model,
        budget_fractions=tuple(args.budgets),
        disk_fraction=args.disk_fraction,
        store_threshold=args.store_threshold,
        kvci_ram_thresholds=tuple(args.kvci_ram_threshold or (DEFAULT_RAM_THRESHOLD,)),
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        session_key_blocks=args.session_key_blocks,
        seed=args.seed,
    )


def results_table(report: SimulationReport) -> Table:
    disk = report.settings.disk_fraction > 0
    table = Table(
        title=(
            f"{report.trace.requests} requests, working set {report.working_set_bytes / GIB:,.0f} GiB "
            f"({report.model.name}); kvci targets: saved >= {TARGET_SAVED_RATIO}x LRU, "
            f"writes >= {TARGET_WRITE_REDUCTION}x fewer"
        )
    )
    headers = ["budget", "policy", "saved Mtok", "hit", "RAM GiB w", *(["disk GiB w"] if disk else []), "tok/GB w"]
    headers += ["saved xLRU", "LRU w/this", "target"]
    for header in headers:
        table.add_column(header, justify="left" if header in ("budget", "policy") else "right")
    for run in report.runs:
        comparisons = {comparison.policy: comparison for comparison in run.comparisons}
        budget = f"{run.budget_fraction:.1%} {run.ram_bytes / GIB:,.0f}G"
        for index, result in enumerate(run.policies):
            comparison = comparisons.get(result.name)
            per_gb = result.saved_tokens_per_gb_written
            cells = [
                budget if index == 0 else "",
                result.name,
                f"{result.saved_tokens / 1e6:.2f}",
                f"{result.token_hit_rate:.1%}",
                f"{result.ram_bytes_written / GIB:,.0f}",
                *([f"{result.disk_bytes_written / GIB:,.0f}"] if disk else []),
                "-" if per_gb is None else f"{per_gb:,.0f}",
                _times(comparison.saved_ratio) if comparison else "1",
                _times(comparison.write_reduction) if comparison else "1",
                _verdict(comparison.target_met) if comparison else "",
            ]
            table.add_row(*cells)
        ceiling = ["", "[dim]never evicts[/dim]", *[""] * (len(headers) - 5), f"[dim]{_times(run.ceiling_saved_ratio)}[/dim]"]
        table.add_row(*ceiling, "", "", end_section=True)
    return table


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _verdict(met: bool | None) -> str:
    if met is None:
        return ""
    return "[green]met[/green]" if met else "[red]missed[/red]"


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
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        plot_report(report, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
