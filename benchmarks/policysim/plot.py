"""The figure: saved prefill tokens and bytes written against the RAM budget, one line per policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from benchmarks.policysim.report import SimulationReport  # noqa: E402

GIB = 1 << 30
TIB = 1 << 40


def plot_report(report: SimulationReport, path: Path) -> None:
    budgets = [run.ram_bytes / GIB for run in report.runs]
    bounds = {result.name for result in report.runs[0].policies if result.reads_the_future}
    names = [result.name for result in report.runs[0].policies]
    figure, (saved_axis, written_axis) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        style = "--" if name in bounds else "-"
        saved = [run.policy(name).saved_tokens / 1e6 for run in report.runs]
        written = [run.policy(name).bytes_written / TIB for run in report.runs]
        saved_axis.plot(budgets, saved, style, marker="o", label=name)
        written_axis.plot(budgets, written, style, marker="o", label=name)
    saved_axis.axhline(report.ceiling_saved_tokens / 1e6, color="grey", linestyle=":", label="never evicts (ceiling)")
    labels = [f"{run.budget_fraction:.1%}\n{run.ram_bytes / GIB:,.0f}" for run in report.runs]
    for axis in (saved_axis, written_axis):
        axis.set_xscale("log")
        axis.set_xticks(budgets, labels)
        axis.minorticks_off()
        axis.set_xlabel(f"RAM budget: share of the working set, GiB ({report.model.name}, {report.bytes_per_token:,} B/token)")
        axis.grid(True, alpha=0.3)
    saved_axis.set_ylabel("saved prefill tokens (millions)")
    written_axis.set_ylabel("bytes written, all tiers (TiB)")
    saved_axis.legend(fontsize="small")
    trace = Path(report.trace.path).name
    figure.suptitle(
        f"{trace}: {report.trace.requests} requests, working set {report.working_set_bytes / TIB:.1f} TiB"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
