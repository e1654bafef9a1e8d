"""vLLM's lookup (`get_num_new_matched_tokens`): how much of a request's prompt kvci can load.

The request's keys are made once (`request_state`); the RAM tier is a dictionary probe, and the
disk tier's catalog is asked only when a disk hit could cover blocks that vLLM's cache and the
RAM tier do not. A disk hit is loaded only when loading is not measured clearly slower than
recomputing (`LoadOrRecompute`). With one full-attention KV cache group a hit is the leading
run of the request's keys; with several, the run every group can load (`GroupLayout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.cache_reset import CacheResets
from kvci_plugin.connector.containment import Containment
from kvci_plugin.connector.groups import GroupLayout
from kvci_plugin.connector.request_state import HitTier, RequestState, RequestStates
from kvci_plugin.connector.window_stages import WindowStages
from kvci_plugin.tiering.health import TierUnavailableError
from kvci_plugin.tiering.load_or_recompute import LoadOrRecompute
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey

Probe = Callable[[Sequence[PageKey]], int]  # how many of these keys, from the first, a tier holds


class Lookups:
    """Finds a request's hit in the tiers (scheduler thread)."""

    def __init__(self, *, requests: RequestStates, manager: TieredCheckpointManager,
                 index: RAMIndex, layout: GroupLayout, slot_bytes: int,
                 load_rule: LoadOrRecompute, resets: CacheResets, stats: c.Counts,
                 contain: Containment, windows: WindowStages | None = None) -> None:
        self.requests = requests
        self.block_size = requests.block_size
        self._manager = manager
        self._index = index
        self._layout = layout
        self._slot_bytes = slot_bytes
        self._load_rule = load_rule
        self._resets = resets
        self._stats = stats
        self._contain = contain
        self._windows = windows if windows is not None and windows.enabled else None
        # One full-attention group: a hit is the leading run of the request's keys.
        self._plain = not layout.hybrid and layout.groups[0].full

    @property
    def disk_answers(self) -> bool:
        """Whether a disk hit is possible now: the tier attached, healthy and not suspended by
        a reset that could not fence it."""
        return bool(self._manager.disk_available) and not self._resets.disk_suspended

    def ram_run(self, st: RequestState, cap: int) -> int:
        """The run of the request's blocks, up to ``cap``, the RAM tier holds."""
        return self._run(st, 0, cap, lambda keys: self._index.longest_prefix(keys, st.tenant))

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens past vLLM's own hit that kvci loads, and whether asynchronously."""
        st = self.requests.state(request)
        st.local_tokens = num_computed_tokens
        if not st.keys or st.generation != self.requests.generation:
            return 0, False
        bs = self.block_size
        cap = (request.num_tokens - 1) // bs  # never match every token: one must be computed
        local = num_computed_tokens // bs
        if self._plain:
            resident = self._index.longest_prefix(st.keys, st.tenant)
            ram = min(resident, cap)
        else:
            ram = resident = self._run(
                st, local, cap, lambda ks: self._index.longest_prefix(ks, st.tenant))
        if st.resident is None:
            st.resident = resident  # the bar learns the first lookup, once the request runs
            if self._windows is not None:
                self._windows.begin(request.request_id, st, self._junctions(st, request, ram, cap))
        disk = 0
        # The catalog is asked only when a disk hit could cover blocks that vLLM's cache and the
        # RAM tier do not: a prefix-cache hit's lookup costs no query.
        if (self._manager.has_disk_tier and max(ram, local) < cap
                and not self._resets.disk_suspended):
            disk = self._disk_lookup(st, local, cap)
            otherwise = max(ram, local)  # computed or loaded from RAM without this hit
            if disk > otherwise and not self._worth_loading(st, disk, otherwise, local):
                disk = 0
        best = max(ram, disk)
        if best <= local:
            return 0, False
        st.hit_tier = HitTier.RAM if ram >= disk else HitTier.DISK
        # A disk load on steps of its own lets other requests run while it reads; with no other
        # request to run it only adds a step (~4 ms here), so it is read before this one's forward.
        # A hybrid model's disk loads are always asynchronous: vLLM takes a failed load of one
        # only as a failed request (block-level load errors need a single KV cache group).
        st.disk_sync = (st.hit_tier is HitTier.DISK and self.requests.only(request.request_id)
                        and not self._layout.hybrid)
        return (best - local) * bs, st.hit_tier is HitTier.DISK and not st.disk_sync

    def _junctions(self, st: RequestState, request: Any, ram: int, cap: int) -> list[int]:
        """Where this request's windows are worth staging besides its own boundaries: vLLM's
        shared-prefix boundary, and the run the RAM tier's full groups hold past the hit the
        sliding ones allow (the next request sharing it then hits all of it)."""
        out = [getattr(request, "shared_prefix_boundary", 0) // self.block_size]
        full = [g for g, group in enumerate(self._layout.groups) if group.full]
        if full and cap > ram:
            keys = self.requests.group_keys(st)
            out.append(min(self._index.longest_prefix(keys[g][:cap], st.tenant) for g in full))
        return [j for j in out if j > ram]

    def _run(self, st: RequestState, first: int, cap: int, probe: Probe) -> int:
        """The run of the request's blocks from ``first`` up to ``cap`` that ``probe``'s tier
        holds (with one full-attention group, from the first block)."""
        assert st.keys is not None
        if self._plain:
            return min(probe(st.keys), cap)
        return self._layout.longest_run(self.requests.group_keys(st), first, cap, probe)

    def _disk_lookup(self, st: RequestState, local: int, cap: int) -> int:
        """The disk tier's run for this request; 0 while the tier is degraded or when its
        dependency fails (the tier's health then skips it until a probe finds it back)."""
        try:
            return self._run(st, local, cap, lambda ks: self._manager.disk_run(ks, st.tenant))
        except TierUnavailableError:
            return 0  # degraded: skipped without asking it
        except Exception as exc:
            self._contain.fault("disk lookup", exc, tier="disk")
            return 0

    def _worth_loading(self, st: RequestState, disk: int, otherwise: int, local: int) -> bool:
        """Load blocks [local, disk) from disk, or recompute those past ``otherwise``?"""
        verdict = self._load_rule.judge((disk - otherwise) * self.block_size,
                                        (disk - local) * self._slot_bytes)
        if not verdict.load and not st.disk_declined:
            st.disk_declined = True
            self._stats.count(c.DISK_HITS_DECLINED)
        return verdict.load


def disk_call(contain: Containment, what: str, call: Callable[..., Any], *args: Any) -> Any:
    """A disk-tier call the engine can do without (recency, discarding a bad page): skipped
    while the tier is degraded, its failure counted; None then."""
    try:
        return call(*args)
    except TierUnavailableError:
        return None
    except Exception as exc:
        contain.fault(what, exc, tier="disk")
        return None
