"""The TTFT benchmark's report and its README table, without an engine.

Running ``benchmarks.ttft --quick`` starts twelve vLLM engines one after another (about 35 s each on
this machine), so no test here runs it; these check what turns its samples into claims: the
targets, the report's self-consistency, the CLI's input checks and the regenerated README.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import kvci_plugin
from benchmarks.ttft import (
    DECODE_PATHS,
    FULL_MODEL,
    PATHS,
    SCHEMA,
    TRACED_PATHS,
    DecodeRate,
    Floors,
    HitPhases,
    PairedHits,
    PathTiming,
    StepShare,
    TTFTReport,
    evaluate_targets,
    hit_phases,
    quieter,
    step_share,
)

REPO_ROOT = Path(kvci_plugin.__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"


def timings(**medians: float) -> dict[str, PathTiming]:
    """One sample per path: ``medians`` overrides the default second each path takes."""
    return {
        name: PathTiming.of("engine", 0 if "miss" in name or name == "recompute" else 4064,
                            [medians.get(name, 1.0)])
        for name in PATHS
    }


def share(value: float = 0.005) -> StepShare:
    return StepShare(
        engine="traced", steps=1, hooks_per_step_s=value * 0.01, step_s=0.01, share=value
    )


def rates(off: float = 100.0, on: float = 100.0, step: float = 0.005) -> dict[str, DecodeRate]:
    return {
        "decode_off": DecodeRate.of("plain", [off]),
        "decode_off_again": DecodeRate.of("plain2", [off]),
        "decode_on": DecodeRate.of("kvci", [on], share(step)),
        "decode_on_again": DecodeRate.of("kvci2", [on]),
        "decode_example_connector": DecodeRate.of("example_connector", [off], share()),
    }


FLOORS = Floors(nbytes=32 << 20, threads=2, copy_one_thread_s=0.004, copy_all_threads_s=0.002,
                copy_cold_one_thread_s=0.008, copy_cold_all_threads_s=0.005,
                read_page_cache_s=0.003, xxh3_s=0.002)
PAIRED = PairedHits.of(131, [0.05], [0.05])
PAIRED_DISK = PairedHits.of(None, [0.05], [0.05])
PHASES = HitPhases(
    total_s=0.04,
    front_s=0.002,
    lookup_s=0.0005,
    steps=1,
    queue_s=0.001,
    load_s=0.003,
    disk_load_s=0.0,
    read_s=0.0,
    scatter_s=0.0,
    forward_s=0.03,
    layer_wait_s=0.001,
    back_s=0.003,
    finish_s=0.0002,
)


def report(
    ttft: dict[str, PathTiming], decode: dict[str, DecodeRate], **overrides: object
) -> TTFTReport:
    fields: dict[str, object] = {
        "command": "python -m benchmarks.ttft",
        "runtime_s": 400.0,
        "vllm_version": "0.0",
        "vllm_cpu_env": {},
        "cpus": 2,
        "load_average": (1.0, 2.0),
        "model": FULL_MODEL,
        "block_size": 32,
        "prompt_tokens": 4096,
        "batched_tokens": 4128,
        "chunk_tokens": 1024,
        "samples": 1,
        "hit_samples": 1,
        "hit_rest_s": 1.0,
        "decode_tokens": 256,
        "decode_prompt_tokens": 64,
        "ttft": ttft,
        "decode": decode,
        "phases": {name: PHASES for name in TRACED_PATHS},
        "floors": FLOORS,
        "paired_ram": PAIRED,
        "paired_disk": PAIRED_DISK,
        "paired_chunked_ram": PAIRED,
        "paired_chunked_disk": PAIRED_DISK,
    }
    fields.update(overrides)
    if "targets" not in fields:
        fields["targets"] = evaluate_targets(ttft, decode, FLOORS, fields["paired_ram"],  # type: ignore[arg-type]
                                            fields["paired_disk"], fields["paired_chunked_ram"],  # type: ignore[arg-type]
                                            fields["paired_chunked_disk"])  # type: ignore[arg-type]
    return TTFTReport.model_validate(fields)


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=120)


@settings(max_examples=100, deadline=None)
@given(
    recompute=st.floats(0.5, 50.0),
    ram=st.floats(0.01, 1.0),
    floor=st.floats(0.01, 1.0),
    disk=st.floats(0.01, 1.0),
    example=st.floats(0.01, 1.0),
    chunked_ram=st.floats(0.01, 1.0),
    chunked_floor=st.floats(0.01, 1.0),
    chunked_disk=st.floats(0.01, 1.0),
    chunked_example=st.floats(0.01, 1.0),
    off=st.floats(10.0, 200.0),
    on=st.floats(10.0, 200.0),
    step=st.floats(0.0, 0.05),
)
def test_targets_follow_the_issue_bounds(
    recompute: float,
    ram: float,
    floor: float,
    disk: float,
    example: float,
    chunked_ram: float,
    chunked_floor: float,
    chunked_disk: float,
    chunked_example: float,
    off: float,
    on: float,
    step: float,
) -> None:
    checks = {t.name: t for t in evaluate_targets(
        timings(recompute=recompute, kvci_ram_hit=ram, prefix_cache_hit=floor, kvci_disk_hit=disk,
                example_connector_hit=example, chunked_kvci_ram_hit=chunked_ram,
                chunked_prefix_cache_hit=chunked_floor, chunked_kvci_disk_hit=chunked_disk,
                chunked_example_connector_hit=chunked_example),
        rates(off=off, on=on, step=step), FLOORS, PAIRED, PAIRED_DISK, PAIRED, PAIRED_DISK)}
    copy = FLOORS.copy_cold_all_threads_s
    assert checks["ram_vs_prefix_cache"].met == (ram / floor <= 1.1)
    assert checks["ram_extra_vs_copy"].met == ((ram - floor) / copy <= 2.0)
    assert checks["ram_speedup"].met == (recompute / ram >= 20.0)
    assert checks["disk_vs_example_connector"].met == (disk / example <= 1.1)
    # Chunked prefill: the same bounds against the same anchors on an engine chunked alike.
    assert checks["chunked_ram_vs_prefix_cache"].met == (chunked_ram / chunked_floor <= 1.1)
    assert checks["chunked_ram_extra_vs_copy"].met == ((chunked_ram - chunked_floor) / copy <= 2.0)
    assert checks["chunked_disk_vs_example_connector"].met == (
        chunked_disk / chunked_example <= 1.1
    )
    assert checks["decode_overhead"].value == pytest.approx(1 - on / off)
    assert checks["decode_overhead"].met == (1 - on / off <= 0.01)
    assert checks["decode_step_share"].value == step
    assert checks["decode_step_share"].met == (step <= 0.01)


def test_phases_come_from_the_hook_records_in_each_samples_window() -> None:
    # Two steps (an asynchronous disk load, then the forward), then a record after the window;
    # the tracer's write after the forward's step is not the hit's time.
    records = [
        ("scheduler", "get_num_new_matched_tokens", 1.000, 1.001, 4064),
        ("scheduler", "update_state_after_alloc", 1.001, 1.0015, None),
        ("scheduler", "build_connector_meta", 1.002, 1.0021, 0),
        ("worker", "bind_connector_metadata", 1.003, 1.0031, None),
        ("worker", "start_load_kv", 1.0031, 1.0035, None),
        ("worker", "wait_for_layer_load", 1.0035, 1.0036, None),  # not the forward's step
        ("worker", "wait_for_save", 1.0036, 1.0037, None),
        ("worker", "get_finished", 1.0037, 1.010, None),
        ("worker", "get_kv_connector_stats", 1.010, 1.0101,
         {"load_disk": [0.006], "phase_disk_read": [0.004], "phase_disk_scatter": [0.002]}),
        ("scheduler", "update_state_after_alloc", 1.011, 1.0111, None),
        ("scheduler", "build_connector_meta", 1.012, 1.0121, 1),
        ("worker", "bind_connector_metadata", 1.013, 1.0131, None),
        ("worker", "start_load_kv", 1.0131, 1.0132, None),
        ("worker", "wait_for_layer_load", 1.014, 1.0155, None),
        ("worker", "wait_for_layer_load", 1.020, 1.0205, None),
        ("worker", "wait_for_save", 1.0432, 1.0433, None),
        ("worker", "get_finished", 1.0433, 1.0434, None),
        ("worker", "get_kv_connector_stats", 1.0434, 1.0435, None),
        ("worker", "trace_flush", 1.0436, 1.049, None),
        # kvci's request_finished runs its request_finished_all_groups: counted once.
        ("scheduler", "request_finished", 1.0440, 1.0444, None),
        ("scheduler", "request_finished_all_groups", 1.0441, 1.0443, None),
        ("worker", "bind_connector_metadata", 2.0, 2.1, None),
    ]
    ph = hit_phases(records, [(0.998, 1.050)])
    assert ph.steps == 2
    assert ph.front_s == pytest.approx(0.002)
    assert ph.lookup_s == pytest.approx(0.0016)
    assert ph.queue_s == pytest.approx(1.013 - 1.0015)  # from the first step's lookup
    assert ph.disk_load_s == pytest.approx(0.006)
    assert (ph.read_s, ph.scatter_s) == pytest.approx((0.004, 0.002))
    assert ph.load_s == pytest.approx(0.0001)
    assert ph.forward_s == pytest.approx(0.03)
    assert ph.layer_wait_s == pytest.approx(0.002)  # the forward's step's two layers
    assert ph.back_s == pytest.approx(1.050 - 1.0435)
    assert ph.finish_s == pytest.approx(0.0004)


def test_a_report_cannot_claim_targets_its_figures_do_not_give() -> None:
    good = report(timings(kvci_ram_hit=0.05, prefix_cache_hit=0.05, chunked_kvci_ram_hit=0.05,
                          chunked_prefix_cache_hit=0.05, recompute=5.0), rates())
    assert all(t.met for t in good.targets)
    forged = [t.model_copy(update={"met": not t.met}) if t.name == "decode_overhead" else t
              for t in good.targets]
    with pytest.raises(ValidationError, match="evaluate_targets"):
        report(good.ttft, good.decode, targets=forged)


def test_decode_overhead_pairs_each_prompt_with_the_plain_engines_run_of_it() -> None:
    # The machine slows down after the first prompt: paired, kvci loses 2% on every prompt;
    # the engines' medians alone would say it gained.
    off = DecodeRate.of("plain", [100.0, 50.0, 50.0])
    on = DecodeRate.of("kvci", [98.0, 98.0, 49.0], share())
    decode = {
        "decode_off": off,
        "decode_off_again": off,
        "decode_on": on,
        "decode_on_again": on,
        "decode_example_connector": DecodeRate.of(
            "example_connector", [100.0, 50.0, 50.0], share()
        ),
    }
    checks = {
        t.name: t
        for t in evaluate_targets(
            timings(), decode, FLOORS, PAIRED, PAIRED_DISK, PAIRED, PAIRED_DISK
        )
    }
    assert checks["decode_overhead"].value == pytest.approx(0.02)
    assert not checks["decode_overhead"].met
    unpaired = {**decode, "decode_on": DecodeRate.of("kvci", [98.0, 49.0], share())}
    with pytest.raises(ValueError, match="strict|shorter|longer"):
        evaluate_targets(timings(), unpaired, FLOORS, PAIRED, PAIRED_DISK, PAIRED, PAIRED_DISK)
    with pytest.raises(ValidationError, match="same prompts"):
        report(timings(), unpaired, targets=())


def test_decode_overhead_pools_each_kinds_two_engines() -> None:
    # One plain engine runs 10% faster than the other whatever it serves; kvci's two are alike
    # and each 5% faster than the slow plain one: pooled, kvci loses 0.25%, where either pair
    # alone says -5% or +4.5%.
    slow, fast = DecodeRate.of("plain", [100.0, 100.0]), DecodeRate.of("plain2", [110.0, 110.0])
    on = DecodeRate.of("kvci", [105.0, 105.0], share())
    decode = {
        "decode_off": slow,
        "decode_off_again": fast,
        "decode_on": on,
        "decode_on_again": DecodeRate.of("kvci2", [105.0, 105.0]),
        "decode_example_connector": DecodeRate.of("example_connector", [100.0, 100.0], share()),
    }
    check = {
        t.name: t
        for t in evaluate_targets(
            timings(), decode, FLOORS, PAIRED, PAIRED_DISK, PAIRED, PAIRED_DISK
        )
    }["decode_overhead"]
    assert check.value == pytest.approx(1 - 210 / 210) and check.met
    decode["decode_on_again"] = DecodeRate.of("kvci2", [95.0, 95.0])
    check = {
        t.name: t
        for t in evaluate_targets(
            timings(), decode, FLOORS, PAIRED, PAIRED_DISK, PAIRED, PAIRED_DISK
        )
    }["decode_overhead"]
    assert check.value == pytest.approx(1 - 200 / 210) and not check.met
    # The traced twins carry the step share: the plain engines and kvci's second do not.
    with pytest.raises(ValidationError, match="carry a step share"):
        report(
            timings(),
            {**decode, "decode_on_again": DecodeRate.of("kvci2", [95.0, 95.0], share())},
            targets=(),
        )
    with pytest.raises(ValidationError, match="carry a step share"):
        report(
            timings(), {**decode, "decode_on": DecodeRate.of("kvci", [105.0, 105.0])}, targets=()
        )


def test_the_step_share_is_each_steps_hooks_over_its_time_without_the_tracers_writes() -> None:
    # Two decode steps of 10 ms (one meta's start to the next) in the window, a third step's
    # meta closing the second; hooks of both roles; the tracer's write in step two is not the
    # step's; records outside the window do not count.
    records = [
        ("scheduler", "build_connector_meta", 0.5, 0.501, 1),
        ("scheduler", "build_connector_meta", 1.000, 1.0001, 1),
        ("worker", "bind_connector_metadata", 1.0002, 1.0003, None),
        ("worker", "wait_for_layer_load", 1.003, 1.0031, None),
        ("worker", "get_kv_connector_stats", 1.009, 1.0091, None),
        ("scheduler", "build_connector_meta", 1.010, 1.0102, 1),
        ("worker", "trace_flush", 1.011, 1.012, None),
        ("worker", "start_load_kv", 1.015, 1.0152, None),
        ("scheduler", "build_connector_meta", 1.020, 1.0201, 1),
        ("scheduler", "build_connector_meta", 2.0, 2.001, 1),
    ]
    got = step_share("kvci", records, [(0.9, 1.05)])
    assert got.steps == 2
    # Step one: 0.1 + 0.1 + 0.1 + 0.1 ms of 10 ms; step two: 0.2 + 0.2 ms of 10 - 1 ms.
    assert got.share == pytest.approx((0.0004 / 0.010 + 0.0004 / 0.009) / 2)
    assert got.hooks_per_step_s == pytest.approx(0.0004)
    assert got.step_s == pytest.approx(0.0095)
    with pytest.raises(RuntimeError, match="no engine step"):
        step_share("kvci", records, [(3.0, 4.0)])


def test_the_paired_bound_is_the_median_of_the_rounds_ratios_not_the_ratio_of_medians() -> None:
    # A slow round slows both hits of it: paired, kvci is 1.05x in every round.
    paired = PairedHits.of(131, [0.021, 0.042, 0.105], [0.020, 0.040, 0.100])
    assert paired.ratio_median == pytest.approx(1.05)
    assert paired.extra_median_s == pytest.approx(0.002)
    checks = {
        t.name: t
        for t in evaluate_targets(
            timings(), rates(), FLOORS, paired, PAIRED_DISK, PAIRED, PAIRED_DISK
        )
    }
    assert checks["paired_ram_vs_prefix_cache"].met
    assert checks["paired_ram_extra_vs_copy"].value == pytest.approx(
        0.002 / FLOORS.copy_cold_all_threads_s
    )
    slower = PairedHits.of(131, [0.025, 0.050], [0.020, 0.040])
    assert not {
        t.name: t
        for t in evaluate_targets(
            timings(), rates(), FLOORS, slower, PAIRED_DISK, PAIRED, PAIRED_DISK
        )
    }["paired_ram_vs_prefix_cache"].met
    with pytest.raises(ValidationError, match="medians"):
        PairedHits(engine_blocks=131, kvci_s=(0.02,), anchor_s=(0.02,), ratio_median=0.9,
                   extra_median_s=0.0)
    with pytest.raises(ValidationError, match="one round per hit sample"):
        report(timings(), rates(), paired_ram=PairedHits.of(131, [0.05, 0.05], [0.05, 0.05]))
    with pytest.raises(ValidationError, match="one round per hit sample"):
        report(timings(), rates(), paired_disk=PairedHits.of(None, [0.05, 0.05], [0.05, 0.05]))
    with pytest.raises(ValidationError, match="one round per hit sample"):
        report(
            timings(), rates(), paired_chunked_ram=PairedHits.of(131, [0.05, 0.05], [0.05, 0.05])
        )
    with pytest.raises(ValidationError, match="one round per hit sample"):
        report(
            timings(), rates(), paired_chunked_disk=PairedHits.of(None, [0.05, 0.05], [0.05, 0.05])
        )
    # Chunked prefill's pair is judged by the same bounds, on its own rounds.
    checks = {
        t.name: t
        for t in evaluate_targets(
            timings(), rates(), FLOORS, PAIRED, PAIRED_DISK, slower, PAIRED_DISK
        )
    }
    assert (
        checks["paired_ram_vs_prefix_cache"].met
        and not checks["paired_chunked_ram_vs_prefix_cache"].met
    )
    assert checks["paired_chunked_ram_extra_vs_copy"].value == pytest.approx(
        0.0075 / FLOORS.copy_cold_all_threads_s
    )


def test_the_paired_disk_bound_is_kvci_over_example_connector_round_by_round() -> None:
    # The machine slows down in the second round: paired, kvci's disk hit is 1.2x in each.
    disk = PairedHits.of(None, [0.036, 0.072, 0.036], [0.030, 0.060, 0.030])
    checks = {
        t.name: t
        for t in evaluate_targets(timings(), rates(), FLOORS, PAIRED, disk, PAIRED, PAIRED_DISK)
    }
    assert checks["paired_disk_vs_example_connector"].value == pytest.approx(1.2)
    assert not checks["paired_disk_vs_example_connector"].met
    assert checks["paired_chunked_disk_vs_example_connector"].met
    fast = PairedHits.of(None, [0.031, 0.062], [0.030, 0.060])
    assert {
        t.name: t
        for t in evaluate_targets(timings(), rates(), FLOORS, PAIRED, fast, PAIRED, PAIRED_DISK)
    }["paired_disk_vs_example_connector"].met
    # The chunked engine's pair is judged on its own rounds.
    checks = {
        t.name: t
        for t in evaluate_targets(timings(), rates(), FLOORS, PAIRED, PAIRED_DISK, PAIRED, disk)
    }
    assert checks["paired_disk_vs_example_connector"].met
    assert checks["paired_chunked_disk_vs_example_connector"].value == pytest.approx(1.2)
    assert not checks["paired_chunked_disk_vs_example_connector"].met


def test_a_report_must_time_every_path_and_state_true_medians() -> None:
    ttft = timings()
    del ttft["kvci_disk_hit"]
    with pytest.raises(ValidationError, match="exactly the paths"):
        report(ttft, rates(), targets=())
    with pytest.raises(ValidationError, match="median"):
        PathTiming(engine="e", cached_tokens=0, seconds=(1.0, 2.0, 9.0), median_s=4.0)


def test_the_cli_refuses_an_unchunked_chunk_size_before_starting_anything() -> None:
    done = run_module("benchmarks.ttft", "--prompt-tokens", "512", "--chunk-tokens", "512")
    assert done.returncode == 2
    assert "--chunk-tokens must be below --prompt-tokens" in done.stderr


@pytest.mark.parametrize("rest", ["-1", "nan", "inf"])
def test_the_cli_refuses_a_rest_that_is_not_a_finite_wait(rest: str) -> None:
    done = run_module("benchmarks.ttft", "--hit-rest", rest)
    assert done.returncode == 2
    assert "--hit-rest must be a finite number of seconds >= 0" in done.stderr


def test_the_readme_table_is_rendered_from_the_json(tmp_path: Path) -> None:
    ttft = timings(
        recompute=5.0,
        kvci_ram_hit=0.093,
        prefix_cache_hit=0.09,
        kvci_disk_hit=0.3,
        example_connector_hit=0.1,
        chunked_kvci_miss=6.0,
        chunked_kvci_ram_hit=0.093,
        chunked_prefix_cache_hit=0.09,
        chunked_kvci_disk_hit=0.36,
        chunked_example_connector_hit=0.3,
    )
    made = report(ttft, rates(off=60.0, on=57.0), command="python -m benchmarks.ttft --samples 1")
    (tmp_path / "ttft.json").write_text(made.model_dump_json(indent=2))
    (tmp_path / "other.json").write_text(json.dumps({"report_format": "something-else"}))
    done = run_module("benchmarks.render_results", "--results", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "skipping other.json" in done.stderr
    readme = (tmp_path / "README.md").read_text()
    assert made.command in readme
    assert "| kvci RAM hit | engine | 4,064 | 0.093 | 0.093 - 0.093 | 53.76x |" in readme
    assert (
        "| kvci disk hit TTFT / ExampleConnector disk hit TTFT | 3.00x | <= 1.10x | no |" in readme
    )
    assert (
        "| chunked prefill: kvci disk hit TTFT / ExampleConnector disk hit TTFT | 1.20x | <= 1.10x "
        "| no |"
        in readme
    )
    assert (
        "| decode tokens/s lost with kvci on (no hits), two engines each | 5.0% | <= 1.0% | no |"
        in readme
    )
    assert "| one engine: kvci's hooks' time / a decode step's | 0.5% | <= 1.0% | yes |" in readme
    assert f"| {DECODE_PATHS['decode_on']} | 57.0 | 57.0 - 57.0 | 0.95x | 50 us | 0.50% |" in readme
    assert f"| {DECODE_PATHS['decode_on_again']} | 57.0 | 57.0 - 57.0 | 0.95x | - | - |" in readme
    assert "two engines started alike differ by 0.0% (the two without a connector)" in readme
    assert (
        "Met: 12 of 15." in readme
    )  # the paired rounds meet both RAM bounds and the disks' (0.05 s each)
    assert "| kvci RAM hit | 0.050 | 0.050 - 0.050 |" in readme
    assert ("| kvci RAM hit | 40.00 | 2.00 | 0.50 | 1 | 1.00 | 3.00 | 0.00 | 0.00 | 0.00 | 30.00 "
            "| 1.00 | 3.00 | 0.20 |") in readme
    assert "one plain copy 4.00 ms on one thread, 2.00 ms on 2; cold" in readme
    assert "8.00 ms and 5.00 ms, the copy the targets' \"extra\" is measured against" in readme
    assert "each hit after the engine idled 1 s, took one short request of another prompt" in readme
    assert "their medians differ by 80%" in readme  # kvci_miss 1.0 s against recompute 5.0 s


def test_the_committed_results_match_the_code_and_the_readme() -> None:
    path = RESULTS / "ttft.json"
    committed = TTFTReport.model_validate_json(path.read_text())
    assert committed.report_format == SCHEMA
    assert committed.command in (RESULTS / "README.md").read_text()


def test_each_floor_is_the_quieter_of_its_two_measurements() -> None:
    later = FLOORS.model_copy(update={"copy_one_thread_s": 0.003, "read_page_cache_s": 0.009})
    floors = quieter(FLOORS, later)
    assert (floors.copy_one_thread_s, floors.read_page_cache_s) == (0.003, FLOORS.read_page_cache_s)
    assert floors.nbytes == FLOORS.nbytes and floors.copy_all_threads_s == FLOORS.copy_all_threads_s
