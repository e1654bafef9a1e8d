"""The scheduler side's composition: the RAM tier, the manager, the keep decision, from the config.

`KVCIScheduler` is built from these parts (``assemble``): the RAM index under the configured
policy (with what it learned before a restart), the connector's mover, the manager over the RAM
and disk tiers with the persistence eligibility gate it asks (``gate``; None: the process-wide
one), the cache gate, the moving RAM bar when the config asks for one, and the `KeepDecider` the
simulator replays too. The `ram_policy` name is resolved here, once (`ram_policy_for`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.mover import ConnectorMover
from kvci_plugin.governance import PersistenceEligibilityGate
from kvci_plugin.policy import (
    KeepDecider,
    PolicyStateFile,
    PolicyStateSaver,
    PressureAwareAdmission,
    RAMPolicy,
    ReturnGaps,
    ram_policy_for,
)
from kvci_plugin.tiering.disk.attach import DiskAttach
from kvci_plugin.tiering.disk.tier import KVCheckpointStore
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey
from kvci_plugin.worthiness import CacheGate, CheckpointAdvisor


@dataclass
class Assembly:
    """The parts the scheduler side is built from."""

    index: RAMIndex
    mover: ConnectorMover
    manager: TieredCheckpointManager
    cache_gate: CacheGate
    bar: PressureAwareAdmission[PageKey] | None  # None: the advisor's fixed RAM threshold
    decider: KeepDecider
    policy_saver: PolicyStateSaver | None
    policy_restored: bool  # what the policy learned before a restart was restored


def assemble(config: KVCIConfig, *, slot_bytes: int, disk: KVCheckpointStore | None,
             disk_attach: DiskAttach | None, events: Any,
             gate: PersistenceEligibilityGate | None) -> Assembly:
    """The scheduler side's parts for ``config``; ValueError when ram_bytes holds no page."""
    num_slots = int(config.ram_bytes) // slot_bytes
    if num_slots < 1:
        raise ValueError(
            f"kvci: ram_bytes ({int(config.ram_bytes)}) holds no page of {slot_bytes} bytes")
    state = PolicyStateFile(config.policy_state_file) if config.policy_state_file else None
    learned = state.restore() if state else None
    ram = ram_policy_for(config.ram_policy)
    index = RAMIndex(num_slots, slot_bytes, config.ram_max_entries,
                     tenant_quota_bytes=config.tenant_quota_bytes,
                     policy=ram.tier_policy(learned))
    saver = PolicyStateSaver(state, index.policy_learned) if state else None
    mover = ConnectorMover()
    advisor = _advisor(config)
    manager = TieredCheckpointManager(
        index=index, mover=mover, advisor=advisor, disk=disk, disk_attach=disk_attach,
        disk_region=config.disk_region, gate=gate)
    if events is not None:
        manager.watch(events)
    # What to keep of each finished request: the decision the simulator replays too.
    cache_gate = _cache_gate(config, ram)
    bar = _pressure_bar(config, ram, advisor, index.capacity_bytes)
    decider = KeepDecider(
        ram=ram, advisor=advisor, gate=cache_gate, sight=index.sight, bar=bar,
        system_trigger=config.system_trigger, auto_promote=config.auto_promote,
        durable_tier=lambda: manager.has_disk_tier, page_bytes=slot_bytes,
        # The pauses after tool-call turns, learned: their automatic retention's TTL (#49).
        return_gaps=ReturnGaps() if config.max_retain_s > 0 else None,
        max_retain_s=config.max_retain_s)
    return Assembly(index=index, mover=mover, manager=manager, cache_gate=cache_gate, bar=bar,
                    decider=decider, policy_saver=saver, policy_restored=learned is not None)


def _advisor(config: KVCIConfig) -> CheckpointAdvisor:
    """The advisor at the configured thresholds (its own defaults where none is set)."""
    kwargs: dict[str, Any] = {}
    if config.ram_threshold is not None:
        kwargs["ram_threshold"] = config.ram_threshold
    if config.disk_threshold is not None:
        kwargs["disk_threshold"] = config.disk_threshold
    return CheckpointAdvisor(**kwargs)


def _cache_gate(config: KVCIConfig, ram: RAMPolicy) -> CacheGate:
    """The cache gate the config sets; its hit-rate floor by default is the RAM policy's."""
    g = config.cache_gate
    return CacheGate(
        kill_switch=g.kill_switch,
        hit_rate_floor=g.hit_rate_floor if g.hit_rate_floor is not None else ram.hit_rate_floor,
        hit_rate_window=g.hit_rate_window, min_lookups=g.min_lookups,
        churn_window_s=g.churn_window_s, churn_threshold=g.churn_threshold)


def _pressure_bar(config: KVCIConfig, ram: RAMPolicy, advisor: CheckpointAdvisor,
                  capacity_bytes: int) -> PressureAwareAdmission[PageKey] | None:
    """The system trigger's RAM bar, moved by the tier's pressure; None: the advisor's own."""
    if not (config.system_trigger and ram.under_bar and config.ram_admission == "pressure"):
        return None
    return PressureAwareAdmission.for_advisor(
        advisor, capacity_bytes=capacity_bytes, min_threshold=config.ram_threshold_min)
