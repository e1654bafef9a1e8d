"""The RAM admission bar's configuration and how its figures travel in `KVCIStats` (no engine;
the bar moving in a live engine is tested in test_connector_ram.py)."""

from __future__ import annotations

import pytest

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.stats import KVCIStats


def test_the_bar_follows_pressure_unless_a_threshold_was_chosen() -> None:
    assert KVCIConfig().ram_admission == "pressure"
    # `kvci serve` passes every flag, unset ones as None: that is no choice.
    assert KVCIConfig.from_extra_config({"ram_threshold": None}).ram_admission == "pressure"
    assert KVCIConfig(ram_threshold=0.6).ram_admission == "fixed"
    chosen = KVCIConfig(ram_threshold=0.6, ram_admission="pressure", ram_threshold_min=0.4)
    assert (chosen.ram_admission, chosen.ram_threshold_min) == ("pressure", 0.4)
    assert KVCIConfig(ram_admission="fixed").ram_admission == "fixed"


def test_the_value_policy_is_the_default_and_a_bar_setting_chooses_the_threshold_policy() -> None:
    assert KVCIConfig().ram_policy == "value"
    assert KVCIConfig.from_extra_config({"ram_threshold": None}).ram_policy == "value"
    for bar in ({"ram_threshold": 0.6}, {"ram_admission": "fixed"}, {"ram_threshold_min": 0.4}):
        assert KVCIConfig.from_extra_config(bar).ram_policy == "threshold"
    assert KVCIConfig(ram_policy="lru").ram_policy == "lru"
    for policy in ("value", "lru"):
        with pytest.raises(
            ValueError,
            match=f"ram_threshold set the worthiness bar, which applies only "
            f"with ram_policy 'threshold' \\(ram_policy is '{policy}'\\)",
        ):
            KVCIConfig.from_extra_config({"ram_policy": policy, "ram_threshold": 0.5})
    with pytest.raises(ValueError, match="ram_policy"):
        KVCIConfig.from_extra_config({"ram_policy": "arc"})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"ram_threshold_min": 0.6}, r"ram_threshold_min \(0.6\) is above .* starts at \(0.55\)"),
        (
            {"ram_threshold": 0.2, "ram_admission": "pressure"},
            r"ram_threshold_min \(0.3\) is above",
        ),
        ({"ram_admission": "fixed", "ram_threshold_min": 0.2}, "ram_threshold_min applies only"),
        ({"ram_threshold": 0.6, "ram_threshold_min": 0.2}, "ram_threshold_min applies only"),
        ({"ram_threshold_min": 0.0}, "ram_threshold_min"),
        ({"ram_admission": "arc"}, "ram_admission"),
    ],
)
def test_bad_bar_settings_are_refused(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCIConfig.from_extra_config(extra)


def test_a_gauge_keeps_the_latest_report_while_counters_add_up() -> None:
    workers = KVCIStats()
    workers.count("lookups", 2)
    scheduler = KVCIStats()
    assert scheduler.is_empty()
    scheduler.gauge("ram_threshold", 0.56)
    assert not scheduler.is_empty()
    scheduler.count("ram_wasted_writes")
    merged = workers.aggregate(scheduler)
    later = KVCIStats()
    later.gauge("ram_threshold", 0.57)
    later.count("ram_wasted_writes")
    merged.aggregate(later)
    assert merged.reduce() == {"lookups": 2, "ram_wasted_writes": 2, "ram_threshold": 0.57}
    # Stats rebuilt from another process's data (as vLLM does) keep their gauges.
    rebuilt = KVCIStats(data=merged.data)
    assert rebuilt.data["gauges"] == {"ram_threshold": 0.57}
    assert KVCIStats(data={"counters": {"lookups": 1}}).data["gauges"] == {}
    merged.reset()
    assert merged.is_empty()
