"""The scheduler side's stats, as vLLM takes them every engine step (`get_kv_connector_stats`).

Every part of the scheduler side counts into one `StepStats` (names in `counters.py`); taking
them hands vLLM what was counted since the last step and starts afresh. What the RAM tier's
policy, the moving RAM bar and the retentions did is read only once it has moved: a decode step
keeps nothing, and its stats cost it nothing.
"""

from __future__ import annotations

import threading

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.retain import report_retentions
from kvci_plugin.connector.stats import KVCIStats
from kvci_plugin.policy import AdmissionStats, PolicyStateSaver, PressureAwareAdmission
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey


class StepStats:
    """The counts of the step under way, and the figures they are measured against."""

    def __init__(self, *, manager: TieredCheckpointManager, index: RAMIndex,
                 bar: PressureAwareAdmission[PageKey] | None,
                 policy_saver: PolicyStateSaver | None, ram_threshold: float) -> None:
        self._stats = KVCIStats()
        # A fault met on one of kvci's own threads (the erasure watch) is counted there.
        self._counting = threading.Lock()
        self._manager = manager
        self._index = index
        self._bar = bar
        self._policy_saver = policy_saver
        self._disk_healthy: bool | None = None  # last reported (a gauge, sent when it changes)
        self.gauge(c.RAM_THRESHOLD, ram_threshold)
        self._bar_reported = bar.stats() if bar is not None else None
        self._policy_reported = index.policy_stats()
        self._policy_changes_seen = index.policy_changes
        first = manager.retention_report(-1)  # never seen: the figures as they stand
        assert first is not None
        self._retention_changes_seen, self._retentions_reported = first

    @property
    def current(self) -> KVCIStats:
        """The stats of the step under way (a take starts new ones)."""
        return self._stats

    def count(self, name: str, n: int | float = 1) -> None:
        with self._counting:
            self._stats.count(name, n)

    def gauge(self, name: str, value: float) -> None:
        self._stats.gauge(name, value)

    def take(self) -> KVCIStats | None:
        """What was counted since the last take; None when nothing was (called every step)."""
        if self._bar is not None:
            self._report_bar(self._bar.stats())
        self._report_policy()
        if self._policy_saver is not None:
            self._policy_saver.tick()
        self._report_retentions()
        healthy = self._manager.disk_available
        if healthy is not None and healthy != self._disk_healthy:
            self._disk_healthy = healthy
            self.gauge(c.TIER_HEALTHY + "disk", 1.0 if healthy else 0.0)
        with self._counting:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVCIStats()
        return stats

    def _report_retentions(self) -> None:
        report = self._manager.retention_report(self._retention_changes_seen)
        if report is None:
            return
        self._retention_changes_seen, now = report
        report_retentions(self._retentions_reported, now, self._stats)
        self._retentions_reported = now

    def _report_policy(self) -> None:
        """The tier policy's refusals and unread evictions since the last report, as counters
        (its admissions and evictions are counted where they happen)."""
        changes = self._index.policy_changes
        if changes == self._policy_changes_seen:
            return
        self._policy_changes_seen = changes
        now = self._index.policy_stats()
        last = self._policy_reported
        for name, was, value in (
                (c.RAM_REFUSED_UNDER_PRESSURE, last.refused_under_pressure,
                 now.refused_under_pressure),
                (c.RAM_EVICTED_UNREAD, last.evicted_before_hit, now.evicted_before_hit)):
            if value > was:
                self.count(name, value - was)
        self._policy_reported = now

    def _report_bar(self, now: AdmissionStats) -> None:
        """The bar's moves since the last report, as counters and the threshold's gauge."""
        last = self._bar_reported
        assert last is not None  # set with the bar
        if now.wasted_writes > last.wasted_writes:
            self.count(c.RAM_WASTED_WRITES, now.wasted_writes - last.wasted_writes)
        if now.missed_reuses > last.missed_reuses:
            self.count(c.RAM_MISSED_REUSES, now.missed_reuses - last.missed_reuses)
        if now.threshold != last.threshold:
            self.gauge(c.RAM_THRESHOLD, now.threshold)
        self._bar_reported = now
