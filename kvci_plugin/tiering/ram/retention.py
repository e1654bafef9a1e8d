"""Retention an agent asks for: a RAM checkpoint exempt from eviction for a bounded time.

An agent that pauses for a tool call knows it will be back; the tier's policy does not. A
retention pins the checkpoint's pages (the RAM index never evicts a checkpoint with a pinned
page) from the moment they are loadable until its TTL ends or the session's next request
arrives, whichever first; then the checkpoint competes like any other. A tenant's retained bytes
stay within its quota (the whole tier without one), so no tenant can hold the tier against
others beyond what it may hold at all. Retention is RAM only: it grants nothing on disk.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import PageKey, PageNotFoundError


class RetentionOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    status: Literal["retained", "refused"]
    ttl_s: float
    reason: str


class RetentionRefused(ValueError):
    """A retention that would take a tenant over its quota; the message names the figures."""


@dataclass
class _Retention:
    tenant: str
    keys: tuple[PageKey, ...]  # distinct
    until: float
    session: str | None
    pool: str  # the fair-share pool its bytes count against
    pinned: bool = False  # pinned once its pages are loadable (its store committed)


@dataclass(frozen=True)
class RetentionStats:
    retentions: int
    retained_bytes: int
    tenant_retained_bytes: dict[str, int]
    expired: int  # ended by their TTL
    released: int  # ended by their session's next request


class Retentions:
    """The retentions of one RAM index; the caller serialises calls (the manager's lock)."""

    def __init__(self, index: RAMIndex, quota_bytes: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        # None: each pool's fair share of the tier at the time of asking (``room``), so that
        # one tenant's retentions never hold more of the tier than an even split gives it.
        self._quota_bytes = quota_bytes
        self._clock = clock
        self._held: dict[str, _Retention] = {}
        self._ends: list[tuple[float, str]] = []  # (until, checkpoint id), stale ones skipped
        self._pages: Counter[PageKey] = Counter()  # retentions naming each page
        self._tenant_pages: Counter[str] = Counter()
        self._pool_pages: Counter[str] = Counter()  # retained pages per fair-share pool
        self._expired = 0
        self._released = 0
        self._changes = 0

    def check(self, tenant: str, keys: Sequence[PageKey], pool: str | None = None) -> None:
        """RetentionRefused when retaining ``keys`` would take the retained bytes of the
        tenant's pool (``pool``, by default the tenant's own) over its quota."""
        pool = tenant if pool is None else pool
        distinct = dict.fromkeys(keys)
        slot = self._index.slot_bytes
        after = (self._pool_pages[pool] + sum(1 for k in distinct if not self._pages[k])) * slot
        quota = (self._quota_bytes if self._quota_bytes is not None
                 else self._index.fair_share_bytes(pool))
        if after > quota:
            what = ("tenant_quota_bytes" if self._quota_bytes is not None else
                    "its fair share of the RAM tier, split among the tenants holding pages")
            raise RetentionRefused(
                f"kvci.retain refused: retaining this request's {len(distinct) * slot} bytes "
                f"would hold {after} bytes for the tenant exempt from eviction, over its quota "
                f"of {quota} bytes ({what})")

    def grant(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey], ttl_s: float,
              session: str | None, pool: str | None = None) -> RetentionOutcome:
        """Retain a checkpoint being kept (``check`` first). Its pages are pinned at
        `committed`."""
        pool = tenant if pool is None else pool
        self.check(tenant, keys, pool)
        distinct = tuple(dict.fromkeys(keys))
        for key in distinct:
            if not self._pages[key]:
                self._tenant_pages[tenant] += 1
                self._pool_pages[pool] += 1
            self._pages[key] += 1
        until = self._clock() + ttl_s
        self._held[checkpoint_id] = _Retention(tenant, distinct, until, session, pool)
        self._index.retained(checkpoint_id)
        heapq.heappush(self._ends, (until, checkpoint_id))
        self._changes += 1
        return RetentionOutcome(status="retained", ttl_s=ttl_s,
                                reason=f"exempt from eviction for {ttl_s:g} s or until the "
                                "session's next request")

    def committed(self) -> None:
        """A store committed: the retentions whose pages are all loadable now are exempt from
        eviction from now on (one sharing a page another store still copies waits for that)."""
        for held in self._held.values():
            if held.pinned:
                continue
            try:
                self._index.pin(held.keys, held.tenant)
            except PageNotFoundError:
                continue
            held.pinned = True

    def dropped(self, checkpoint_id: str) -> None:
        """The checkpoint's store failed: nothing to retain."""
        held = self._held.pop(checkpoint_id, None)
        if held is not None:
            self._end(held)

    def release_session(self, tenant: str, session: str) -> None:
        """The session's next request arrived: its retentions end."""
        ended = [c for c, r in self._held.items() if r.tenant == tenant and r.session == session]
        for cid in ended:
            self._end(self._held.pop(cid))
            self._released += 1

    def forget(self, tenant: str) -> None:
        """The tenant was forgotten: its retentions end now, not at their TTL."""
        for cid in [c for c, r in self._held.items() if r.tenant == tenant]:
            self._end(self._held.pop(cid))

    def expire(self) -> None:
        """End the retentions whose TTL has passed (cheap when none has)."""
        now = self._clock()
        while self._ends and self._ends[0][0] <= now:
            until, cid = heapq.heappop(self._ends)
            held = self._held.get(cid)
            if held is not None and held.until == until:
                del self._held[cid]
                self._end(held)
                self._expired += 1

    def clear(self) -> None:
        """A cache reset emptied the index (its pins with it): forget every retention."""
        self._held.clear()
        self._ends.clear()
        self._pages.clear()
        self._tenant_pages.clear()
        self._pool_pages.clear()
        self._changes += 1

    @property
    def changes(self) -> int:
        """A count that has moved whenever ``stats`` may have changed: a reader polling them
        every engine step builds them only when this has moved."""
        return self._changes

    def stats(self) -> RetentionStats:
        slot = self._index.slot_bytes
        return RetentionStats(
            retentions=len(self._held),
            retained_bytes=sum(self._tenant_pages.values()) * slot,
            tenant_retained_bytes={t: n * slot for t, n in self._tenant_pages.items()},
            expired=self._expired,
            released=self._released,
        )

    def _end(self, held: _Retention) -> None:
        self._changes += 1
        if held.pinned:
            self._index.unpin(held.keys)
        for key in held.keys:
            self._pages[key] -= 1
            if not self._pages[key]:
                del self._pages[key]
                self._tenant_pages[held.tenant] -= 1
                if not self._tenant_pages[held.tenant]:
                    del self._tenant_pages[held.tenant]
                self._pool_pages[held.pool] -= 1
                if not self._pool_pages[held.pool]:
                    del self._pool_pages[held.pool]
