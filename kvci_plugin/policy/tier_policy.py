"""The contract between the RAM index and the policy that decides what it keeps.

The index owns the mechanism (slots, pages shared between checkpoints, pins, tenants, quotas,
bounds); the policy owns the two choices: the order in which checkpoints leave, and whether a
newcomer is worth what it would displace. The index calls the policy under its own lock, so a
policy needs no lock of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvci_plugin.policy.offer import Offer
from kvci_plugin.policy.reuse_hazard import HazardCounts


@dataclass(frozen=True, slots=True)
class PolicyStats:
    policy: str
    # Checkpoints the policy let in, and those of them kept explicitly (whatever it weighed).
    admitted: int
    admitted_explicit: int
    # Checkpoints evicted to make room for an admitted one.
    displaced: int
    # Offers turned away because they were worth less than what they would have displaced.
    refused_under_pressure: int
    # Evicted checkpoints whose context no lookup re-sent while they were held: writes that
    # bought nothing.
    evicted_before_hit: int
    # Contexts the policy remembers (held or not) to learn how soon they come back.
    tracked_anchors: int


class TierPolicy(Protocol):
    name: str

    def observe_lookup(self, chain: Sequence[Hashable], now: float) -> None:
        """A request's prompt keys at its lookup: which remembered anchors it re-sent."""
        ...

    def sighted(self, offer: Offer, now: float) -> None:
        """A request finished (kept or not): remember its anchor."""
        ...

    def eviction_order(self, entries: Mapping[str, Any], now: float) -> Iterator[str]:
        """Every held checkpoint id, first to leave first; ``entries`` is the index's LRU order."""
        ...

    def admits(self, offer: Offer, victims: Sequence[str], now: float,
               displaced: Collection[str] | None = None) -> bool:
        """Whether ``offer`` is worth evicting ``victims`` (empty: there is room);
        ``displaced``: those of them whose pages leave with them (None: all)."""
        ...

    def admitted(self, checkpoint_id: str, offer: Offer, now: float) -> None: ...

    def resent_prefix(self, chain: Sequence[Hashable]) -> tuple[int, Offer] | None:
        """For a checkpoint of ``chain`` just kept by the system: how many leading keys the
        index also keeps as a checkpoint of their own (their pages are already held: no copy),
        and its offer; None: none."""
        ...

    def trimmed(self, checkpoint_id: str, anchor: Hashable) -> None:
        """The index freed the checkpoint's tail for room: it holds the context up to ``anchor``
        now (a shorter prefix of its own), and stays where it was in the order of leaving."""
        ...

    def retained(self, checkpoint_id: str) -> None:
        """An order holds the checkpoint (a retention): how long it stays is the order's, not
        the policy's choice."""
        ...

    def touched(self, checkpoint_ids: Sequence[str], now: float) -> None:
        """A load read these checkpoints' pages."""
        ...

    def dropped(self, checkpoint_id: str, *, evicted: bool) -> None:
        """The checkpoint left: evicted for room, or removed / aborted / cleared by its owner."""
        ...

    def cleared(self) -> None:
        """A cache reset: every checkpoint and every remembered anchor is gone."""
        ...

    def learned(self, now: float) -> HazardCounts | None:
        """What the policy learned about the workload, for a restarted tier to start from
        (``kvci_plugin.policy.policy_state``); None: it learns nothing."""
        ...

    def stats(self) -> PolicyStats: ...
