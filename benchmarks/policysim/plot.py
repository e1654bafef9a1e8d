"""The figure: against the RAM budget, one line per policy: saved prefill tokens, saved tokens over
LRU's, and bytes written over LRU's."""

from __future__ import annotations

from math import nan
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from benchmarks.policysim.report import BASELINE, TARGET_POLICY, SimulationReport, target_for  # noqa: E402

GIB = 1 << 30
TIB = 1 << 40


def plot_report(report: SimulationReport, path: Path) -> None:
    budgets = [run.ram_bytes / GIB for run in report.runs]
    bounds = {result.name for result in report.runs[0].policies if result.reads_the_future}
    names = [result.name for result in report.runs[0].policies]
    figure, (saved_axis, ratio_axis, written_axis) = plt.subplots(1, 3, figsize=(19, 5.5))
    # tab10 repeats after ten lines; a sweep runs more policies than that.
    colours = plt.get_cmap("tab20")
    for index, name in enumerate(names):
        style = "--" if name in bounds else "-"
        colour = colours(index % colours.N)
        results = [(run.policy(name), run.policy(BASELINE)) for run in report.runs]
        saved = [result.saved_tokens / 1e6 for result, _ in results]
        # A ratio is undefined where LRU saved (or wrote) nothing: left out of the line.
        saved_ratio = [
            result.saved_tokens / lru.saved_tokens if lru.saved_tokens else nan
            for result, lru in results
        ]
        written = [
            result.bytes_written / lru.bytes_written if lru.bytes_written else nan
            for result, lru in results
        ]
        for axis, values in (
            (saved_axis, saved),
            (ratio_axis, saved_ratio),
            (written_axis, written),
        ):
            axis.plot(budgets, values, style, marker="o", color=colour, label=name)
    saved_axis.axhline(
        report.ceiling_saved_tokens / 1e6,
        color="grey",
        linestyle=":",
        label="never evicts (ceiling)",
    )
    ratio_axis.axhline(1.0, color="grey", linestyle=":")
    targets = [(run.ram_bytes / GIB, target_for(run.budget_fraction)) for run in report.runs]
    marked = [(budget, target.saved_ratio) for budget, target in targets if target is not None]
    if marked:
        ratio_axis.plot(
            *zip(*marked), "k_", markersize=18, markeredgewidth=2, label=f"{TARGET_POLICY} target"
        )
    labels = [f"{run.budget_fraction:.1%}\n{run.ram_bytes / GIB:,.0f}" for run in report.runs]
    for axis in (saved_axis, ratio_axis, written_axis):
        axis.set_xscale("log")
        axis.set_xticks(budgets, labels)
        axis.minorticks_off()
        axis.set_xlabel(
            f"RAM budget: share of the working set, GiB ({report.model.name}, "
            f"{report.bytes_per_token:,} B/token)"
        )
        axis.grid(True, alpha=0.3)
    written_axis.set_yscale("log")
    saved_axis.set_ylabel("saved prefill tokens (millions)")
    ratio_axis.set_ylabel("saved prefill tokens / LRU's")
    written_axis.set_ylabel("bytes written, all tiers / LRU's")
    ratio_axis.legend(fontsize="small")
    trace = Path(report.trace.path).name
    figure.suptitle(
        f"{report.label} ({trace}): {report.trace.requests} requests, working set "
        f"{report.working_set_bytes / TIB:.1f} TiB"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
