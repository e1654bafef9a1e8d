"""PageMover: who copies the manager's pages between the KV cache, the RAM pool and the blobs.

Inside vLLM the connector queues the copies as jobs for its workers and tells the manager when
they report back (``on_stored`` / ``on_persisted``); a mover that copies at once (in one
process: the tests' ``LocalPageMover``) returns True, and the manager never waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvci_plugin.tiering.types import PageKey, Reservation


class PageMover(Protocol):
    """Copies pages for the manager. Each call returns True when the copy is already done;
    False means it was queued and the manager hears back through `on_stored` / `on_persisted`."""

    def store(self, reservation: Reservation, source: Any) -> bool: ...

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool: ...
