"""The names of kvci's connector stats (`KVCIStats`), one place for the side that counts and for
`prom.py`, which maps each to its Prometheus series.

A labelled name is a prefix and its label value (``HIT_TOKENS + "disk"``): the values come from
fixed sets (tiers, gate checks), so /metrics' labels stay bounded. Fault counters are named by
`containment.fault_counter`. No vllm here.
"""

from __future__ import annotations

from typing import Protocol


class Counts(Protocol):
    """Where a part of the connector counts (`StepStats` on the scheduler side)."""

    def count(self, name: str, n: int | float = 1) -> None: ...

    def gauge(self, name: str, value: float) -> None: ...

# ---- counters -----------------------------------------------------------------------------------

LOOKUPS = "lookups"
CHECKPOINTS_RAM = "checkpoints_ram"
EVICTED_CHECKPOINTS = "evicted_checkpoints"
STORE_DECLINED = "store_declined"
STORE_OPTED_OUT = "store_opted_out"
RAM_REFUSED_UNDER_PRESSURE = "ram_refused_under_pressure"
RAM_EVICTED_UNREAD = "ram_evicted_unread"
CACHE_RESETS = "cache_resets"
CHECKPOINTS_FENCED = "checkpoints_fenced"
CACHE_RESET_FAILURES = "cache_reset_failures"
DISK_HITS_DECLINED = "disk_hits_declined"
PERSISTED_CHECKPOINTS = "persisted_checkpoints"
PERSIST_FAILURES = "persist_failures"
DISK_LOAD_ERRORS = "disk_load_errors"
DISK_CHECKPOINTS_DISCARDED = "disk_checkpoints_discarded"
CACHE_GATE_PAUSES = "cache_gate_pauses"
CACHE_GATE_PREFIX_KEEPS = "cache_gate_prefix_keeps"
PARAMS_ERRORS = "params_errors"
RAM_WASTED_WRITES = "ram_wasted_writes"
RAM_MISSED_REUSES = "ram_missed_reuses"
RETENTIONS_RETAINED = "retentions_retained"
RETENTIONS_REFUSED = "retentions_refused"
RETENTIONS_EXPIRED = "retentions_expired"
RETENTIONS_RELEASED = "retentions_released"
TOOL_CALLS_DETECTED = "tool_calls_detected"  # turns the engine saw end on a tool call (#49)
RETENTIONS_AUTOMATIC = "retentions_automatic"  # of them, retained through the pause
RETENTIONS_AUTOMATIC_HITS = "retentions_automatic_hits"  # loaded by the session's next request
RETENTIONS_AUTOMATIC_EXPIRED = "retentions_automatic_expired"  # TTL ended, the session not back
RETENTIONS_KV_HINTS = "retentions_kv_hints"  # retentions granted on a kv_hints order
WINDOW_STAGES = "window_stages"
WINDOW_STAGES_SKIPPED = "window_stages_skipped"
WINDOW_BOUNDARIES_MISSED = "window_boundaries_missed"

# ---- gauges -------------------------------------------------------------------------------------

RAM_THRESHOLD = "ram_threshold"
RAM_RETAINED_BYTES = "ram_retained_bytes"
TIER_HEALTHY = "tier_healthy_"  # + tier

# ---- labelled counters: prefix + label value ----------------------------------------------------

HIT_TOKENS = "hit_tokens_"  # + tier
FAILED_HIT_TOKENS = "failed_hit_tokens_"  # + tier
LOADED_BYTES = "loaded_bytes_"  # + tier
STORED_BYTES = "stored_bytes_"  # + tier
RECOMMENDATIONS = "recommendations_"  # + recommended tier
GATE_REFUSALS = "gate_refusals_"  # + the eligibility gate's failed check

# ---- latencies (histograms): prefix + label value -----------------------------------------------

LOAD_SECONDS = "load_"  # + tier
STORE_SECONDS = "store_"  # + tier
PHASE_SECONDS = "phase_"  # + a disk load's phase
