"""The scale benchmark (``benchmarks/bench_scale.py``) at tiny sizes: it runs, its report holds
what the results README reads, and a bad policy name fails before any run (no timed
assertions: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_scale import (
    CALLS,
    SCHEMA,
    Tier,
    Workload,
    load_scales,
    main,
    run_one,
    scale_section,
)


def test_quick_run_writes_a_report_the_readme_renders(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert main(["--quick", "--pages", "1e3", "--policy", "value,lru", "--out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["report_format"] == SCHEMA
    assert [(r["pages"], r["policy"]) for r in report["runs"]] == [(1000, "value"), (1000, "lru")]
    for run in report["runs"]:
        assert run["requests"] == 200 and run["held_pages"] <= 1000
        assert set(run["per_call"]) <= set(CALLS) and "checkpoint_now" in run["per_call"]
        assert run["per_request"]["n"] == 200
        assert run["rss_per_held_page_b"] > 0
        assert set(run["reads_us"]) == {"ram_stats", "index_stats", "explain_without_tenant",
                                        "policy_learned"}
        assert run["forget_us"] > 0
    (path, loaded), = load_scales(tmp_path)
    section = "\n".join(scale_section(path, loaded))
    assert section.startswith("## scale") and "| 1,000 | value |" in section


def test_the_workload_is_seeded_and_grows_prompts_turn_by_turn() -> None:
    first = [Workload(7).next() for _ in range(1)]
    a, b = Workload(7), Workload(7)
    assert [a.next()[0] for _ in range(50)] == [b.next()[0] for _ in range(50)]
    chain, offer = first[0]
    assert offer.anchor == chain[-1] and all(len(k) == 16 for k in chain)


def test_one_run_fills_past_the_tier_and_evicts() -> None:
    run = run_one(800, "value", requests=30, fill=1.5, seed=1)
    assert run["fill_requests"] > 0 and run["held_pages"] <= 800 and run["evictions"] > 0
    assert run["forget_us"] > 0
    tier = Tier(800, "lru")
    assert tier.index.stats().pages == 0


def test_a_policy_not_offered_is_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ram_policy must be one of"):
        main(["--quick", "--pages", "1e3", "--policy", "keep-all", "--out",
              str(tmp_path / "x.json")])
