"""A bound, not a policy: kvci's own policy with its evidence learned in hindsight.

``kvci-hindsight`` replays the connector's default RAM tier (``KVCITier`` with ``ValuePolicy``)
with each class's reuse hazard already what the online run had learned by the trace's end, at the
same budget, and learning nothing more. The classes and the idle ages it weighs are the online
policy's, so it shows what that evidence (the worthiness score's band, how often a context came
back, how long it has sat idle) can buy when the learning is perfect: a target above it needs
evidence the policy does not have (whether a session continues: the ``oracle`` bounds), not
faster learning.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvci_plugin.policy import ValuePolicy
from kvci_plugin.policy.reuse_hazard import Live, ReuseHazard

NAME = "kvci-hindsight"


class FrozenHazard(ReuseHazard):
    """Weighs as ``learned`` did when it was taken, and learns nothing more."""

    def __init__(self, learned: ReuseHazard) -> None:
        super().__init__()
        self._weigh_by(list(learned._rows), learned._table.copy())

    def ended(self, cls: Hashable, age_s: float, *, reused: bool) -> None:
        return None

    def refresh(self, live: Live) -> None:
        return None


def hindsight_policy(online: ValuePolicy, end_s: float) -> ValuePolicy:
    """A fresh ``ValuePolicy`` that weighs by what ``online`` learned by ``end_s``."""
    return ValuePolicy(hazard=FrozenHazard(online.reuse_hazard(end_s)))
