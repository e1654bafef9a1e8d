"""Values and errors shared by the two halves of the RAM tier (index and page pool).

The index lives on vLLM's scheduler side and the bytes in the worker's pool; these records are
what crosses between them and out to the connector, so they are plain frozen dataclasses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Only named in annotations: the worker side, which imports these records, imports no
    # policy (numpy, pydantic, the worthiness layer) for them (a reservation's arrays are the
    # index's, read through their own methods).
    import numpy as np

    from kvci_plugin.policy import PolicyStats

PageKey = bytes
"""A page is named by its 128-bit kvci block key (namespace and tenant are hashed into it)."""

PAGE_KEY_BYTES = 16


def check_page_key(key: object, field_name: str = "keys") -> PageKey:
    """Return ``key`` if it is a 16-byte ``bytes``; raise a clear error otherwise."""
    if not isinstance(key, bytes):
        raise TypeError(f"{field_name}: a page key must be bytes, not {type(key).__name__}")
    if len(key) != PAGE_KEY_BYTES:
        raise ValueError(
            f"{field_name}: a page key must be {PAGE_KEY_BYTES} bytes, not {len(key)}"
        )
    return key


def check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
    if not tenant:
        raise ValueError("tenant must not be empty")
    return tenant


def check_checkpoint_id(checkpoint_id: object) -> str:
    if not isinstance(checkpoint_id, str):
        raise TypeError(f"checkpoint_id must be a str, not {type(checkpoint_id).__name__}")
    if not checkpoint_id:
        raise ValueError("checkpoint_id must not be empty")
    return checkpoint_id


class RAMTierError(Exception):
    """Base of the RAM tier's typed refusals."""


class TenantMismatchError(RAMTierError):
    """A checkpoint or page exists but belongs to another tenant: refused, never returned.

    The message never names the owning tenant.
    """


class CheckpointNotFoundError(RAMTierError, KeyError):
    """No checkpoint with this id is held (never stored, evicted, removed or aborted)."""

    def __str__(self) -> str:
        # KeyError's str() wraps the message in quotes; keep it readable.
        return str(self.args[0]) if self.args else ""


class CheckpointFencedError(CheckpointNotFoundError):
    """The checkpoint was dropped by a cache reset: its KV predates the reset and never loads."""

    def __init__(self, checkpoint_id: str, fenced_at: float, generation: int) -> None:
        super().__init__(
            f"checkpoint {checkpoint_id!r} was fenced by a cache reset at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(fenced_at))} (generation "
            f"{generation} began): its KV was computed before the reset and is never loaded")
        self.fenced_at = fenced_at
        self.generation = generation


class TenantForgottenError(RAMTierError):
    """A write of a tenant that was forgotten (crypto-erased) after the write's KV was computed."""


class CheckpointForgottenError(CheckpointNotFoundError):
    """The checkpoint's tenant was forgotten: its keys are destroyed, its KV never loads again."""

    def __init__(self, checkpoint_id: str, forgotten_at: float) -> None:
        super().__init__(
            f"checkpoint {checkpoint_id!r} was forgotten at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(forgotten_at))}: its tenant's keys "
            "were destroyed (crypto-erasure) and its KV is never loaded again")
        self.forgotten_at = forgotten_at


class PageNotFoundError(RAMTierError, KeyError):
    """A page needed by a load is missing or its bytes are not copied in yet."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointExistsError(RAMTierError, ValueError):
    """A reservation reused a checkpoint id that is already held."""


class CheckpointBusyError(RAMTierError, RuntimeError):
    """The operation does not apply to the checkpoint's state (pending vs committed)."""


class DoesNotFitError(RAMTierError):
    """A reservation cannot be satisfied; nothing was changed.

    ``bound`` names what stood in the way: ``"max_entries"``, ``"max_bytes"``,
    ``"tenant_quota_bytes"``, or ``"erasure"`` (a page still being erased).
    """

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound


class NotWorthDisplacingError(DoesNotFitError):
    """The tier is full and its policy values what the checkpoint would evict more."""

    def __init__(self, message: str) -> None:
        super().__init__("policy", message)


@dataclass(frozen=True)
class CheckpointEntry:
    """A snapshot of one checkpoint held by the RAM index.

    ``nbytes`` counts each distinct page once (``pages * slot_bytes``); pages shared with other
    checkpoints are counted in each entry but held once in RAM. ``pending`` is True between
    ``reserve`` and ``commit``; ``complete`` is True when every page's bytes are in the pool.
    """

    checkpoint_id: str
    tenant: str
    keys: tuple[PageKey, ...]
    nbytes: int
    created: float
    last_used: float
    pending: bool
    complete: bool
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Eviction:
    """A checkpoint the index dropped to make room (reported so the connector can count it)."""

    checkpoint_id: str
    tenant: str
    # Its pages that left the tier with it (a page it shared with a held checkpoint stays).
    freed: tuple[PageKey, ...]
    # Only its tail left: the checkpoint holds its head on (``RAMIndex`` trims a last victim
    # that would free more pages than wanted).
    trimmed: bool = False


@dataclass(frozen=True)
class Erased:
    """What a forget dropped from the RAM tier (``RAMIndex.erase``)."""

    checkpoint_ids: tuple[str, ...]
    # The keys of the pages loadable until the forget: freed, or unloadable from now on while a
    # load still pins them (freed at its unpin).
    unloaded: tuple[PageKey, ...]


@dataclass(frozen=True)
class Reservation:
    """What the worker must do to store a checkpoint.

    ``new_keys`` and ``new_slots`` (aligned) are the pages whose bytes the worker must copy
    before ``commit``; ``evicted`` lists the checkpoints dropped to make room. ``slots`` (lined up
    with the reserved keys), ``reused_keys`` and ``reused_slots`` (the pages already held, each
    deduplicated) are read from the reservation's columns when asked: a store reuses most of
    its hundreds of pages, and the connector needs only the new ones (made for every store on
    the scheduler thread, they were lists and tuples of hundreds of entries each).
    """

    checkpoint_id: str
    tenant: str
    new_keys: tuple[PageKey, ...]
    new_slots: tuple[int, ...]
    evicted: tuple[Eviction, ...]
    # The reserved keys once each, in order; each one's slot, and whether its page is new.
    distinct: tuple[PageKey, ...] = field(repr=False)
    distinct_slots: np.ndarray = field(repr=False)
    fresh: np.ndarray = field(repr=False)
    # Where each reserved key is in ``distinct`` when a key repeats (None: none does).
    order: np.ndarray | None = field(default=None, repr=False)

    @property
    def slots(self) -> tuple[int, ...]:
        at = self.distinct_slots if self.order is None else self.distinct_slots[self.order]
        return tuple(at.tolist())

    @property
    def reused_keys(self) -> tuple[PageKey, ...]:
        return tuple(compress(self.distinct, (~self.fresh).tolist()))

    @property
    def reused_slots(self) -> tuple[int, ...]:
        return tuple(self.distinct_slots[~self.fresh].tolist())

    @property
    def reused_pages(self) -> int:
        return len(self.distinct) - len(self.new_keys)


@dataclass(frozen=True)
class RAMStats:
    """Occupancy of the RAM tier. Hits and lookups are counted by the connector, not here."""

    entries: int
    pending_entries: int
    pages: int
    pinned_pages: int
    bytes_used: int
    capacity_bytes: int
    max_entries: int
    slot_bytes: int
    num_slots: int
    tenant_bytes: Mapping[str, int]
    tenant_quota_bytes: int | None
    evictions: int
    # What the tier policy did: admitted, displaced, refused under pressure, evicted unread.
    policy: PolicyStats
