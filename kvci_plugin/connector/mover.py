"""The connector's `PageMover`: the manager's copies, queued as jobs for the next step.

The manager asks for a store (GPU blocks -> RAM slots) when it keeps a finished request's KV and
for a persist (RAM slots -> disk blobs) when the gate permits a durable copy; the workers run
them with the step's metadata and report back (`on_stored`, `on_persisted`). Neither copies at
once, so both answer False ("not done yet").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvci_plugin.connector.jobs import PersistJob, StoreJob
from kvci_plugin.tiering.types import PageKey, Reservation


class ConnectorMover:
    """Queues the manager's copies as jobs for the next step's metadata."""

    def __init__(self) -> None:
        self.stores: list[StoreJob] = []
        self.persists: list[PersistJob] = []
        self.window_stores: list[StoreJob] = []  # running requests' windows (`window_stages`)

    def store(self, reservation: Reservation, source: Any) -> bool:
        req_id, page_of = source  # page key -> (block id, KV cache group)
        pages = [page_of[key] for key in reservation.new_keys]
        self.stores.append(StoreJob(
            req_id=req_id, checkpoint_id=reservation.checkpoint_id,
            slots=list(reservation.new_slots), block_ids=[b for b, _ in pages],
            groups=[g for _, g in pages]))
        return False

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool:
        self.persists.append(PersistJob(checkpoint_id=checkpoint_id, tenant=tenant,
                                        keys=list(keys), slots=list(slots)))
        return False

    def take(self) -> tuple[list[StoreJob], list[PersistJob]]:
        """The jobs queued since the last step (caller holds the manager's lock)."""
        stores, persists = self.stores, self.persists
        self.stores, self.persists = [], []
        return stores, persists

    def take_windows(self) -> list[StoreJob]:
        """The window stores planned for this step (caller holds the manager's lock)."""
        jobs, self.window_stores = self.window_stores, []
        return jobs

    @property
    def pending(self) -> bool:
        return bool(self.stores or self.persists)
