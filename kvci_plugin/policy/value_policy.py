"""ValuePolicy: kvci's RAM tier policy — keep what is expected to save the most per byte held.

Rules, each with the anchor it comes from:

- **Value.** A held checkpoint is worth ``P x rebuild seconds per page``: ``P`` is how likely a
  context of its class, idle as long as it has been, is re-sent within the tier's holding horizon
  (``ReuseHazard``, after "KVCache Cache in the Wild": reuse probability by workload class and
  idle age), and the rebuild cost is the shared ``RebuildCostEstimate`` of the context's work per
  page (``offer_rebuild_s``: not the engine's measured wall time, so that the engine and the
  simulator weigh the same context alike). The horizon is how long the tier holds what it admits
  now, measured: the median idle age of its latest victims (the characteristic time of Che's
  approximation for LRU caches); a return later than the tier can wait for is worth nothing to it.
  A victim an order held (a retention: the engine's automatic one through an agent's tool call, or
  ``kvci.retain``) is left out: its pins, not the tier, set how long it stayed, and counting it
  stretched the horizon and cost hits at the small budgets of the agent trace
  (``benchmarks.policy_sim``). A class is the worthiness score's band, how often the context's
  anchor was re-sent since (a frequency, as LFU and TinyLFU count it), and what the client said of
  the turn's end (``tool_call_pending``: true, false, not said; below); not also whether the
  request continued an earlier one: that split each class's evidence three ways and cost hits at
  every budget it moved (``benchmarks.policy_sim``). The learning costs no bytes: every request's
  anchor is remembered whether it was kept or not (S3-FIFO's and ARC's ghosts), so the policy
  learns what its refusals would have bought.
- **What the client says is evidence.** An agent knows when its turn ends on a tool call and it
  will be back (Continuum's point: keep a tool call's context for the pause); it says so in the
  observation's ``tool_call_pending``. Its contexts form classes of their own, learned like the
  rest, so the word weighs as much as it proves: whether a session continues is the evidence
  kvci's own lacks: told by a client that is always right (``kvci-told``) kvci saves more than
  told nothing at every budget, and the same word said at random (``kvci-told-random``) costs
  only what splitting the evidence costs (``benchmarks.policy_sim``; the figures are in
  benchmarks/results/README.md, policy_sim_conversation). Without it every context is "not
  said", one class as before. An order to keep is ``kvci.retain``, not this.
- **Admission.** With room, every offer is kept: refusing into free memory buys nothing (the
  gap the old RAM bar left). Under pressure an offer is kept only if it is worth at least the
  most valuable checkpoint it would displace (TinyLFU's "admit only if worth more than the
  victim"); otherwise it stays a remembered anchor, and comes in when its class proves itself.
  What it displaces is the victims whose pages leave with them (``displaced``: a victim whose
  every page stays, reused by the offer or held by a checkpoint that stays, or leaving with a
  later victim, takes nothing from the tier), and not the head of a checkpoint already chosen
  to leave (``trimmed``): the admission that cut it let it go, and evicted whole its pages were
  free for the next offers; weighed against it, the tier refused into what had been free room
  and the conversation trace saved 1.4 % less at 2.5 % of its working set
  (``benchmarks.policy_sim``).
  Only full blocks are ever offered (the engine keeps no partial block).
- **A re-sent prefix keeps its own value.** When the system keeps a request whose prompt re-sent
  an earlier context that holds no checkpoint (refused, or evicted), the index also keeps that
  prefix's pages as a checkpoint of their own, with no copy: the new checkpoint's class is a
  first sighting's, the prefix's is its own, proven by the re-send (store-after-2's and
  S3-FIFO's point that what came back once is likelier to come back, kept per context). Without
  it the prefix left with the newcomer's tail, as early as any first sighting, and the smallest
  budgets saved less (``benchmarks.policy_sim``).
- **Eviction.** Lowest value first. Within a class value mostly falls with idle age, so each
  class is an LRU list and only the heads compete (a heap): eviction costs a few comparisons, not a
  scan. A chain leaves tail first with no rule of its own: a continuation's checkpoint shares
  its parent's pages, and the index frees a page only with its last holder, so a page's
  priority is the highest of its holders' and never rises from root to tail. The index frees no
  more pages than wanted: a last victim that would free more keeps its head (``trimmed``), weighed
  still as the context it was kept for (its anchor, class and age: the cut is where room ran out,
  not a context anyone sent; anchored there, every continuation passing the cut counted one more
  return of its class, and each cut left a ghost), first to leave of its class, and counted in
  the horizon once, when it began to leave.
- **Explicit checkpoints and vetoes come before value.** An explicit checkpoint
  (``checkpoint: "now"``, the control surface) is admitted whatever its value and is evicted
  only after every other checkpoint;
  ``never``, vetoes and the self-report rule never reach the policy (nothing is offered);
  pins, in-flight copies, tenant quotas and the bounds are the index's and hold whatever the
  policy orders.
- **What it learned can outlive the process.** ``learned`` is the hazard's counts with every
  context still idle counted as idle so far; with ``policy_state_file`` a restarted engine starts
  from them instead of the prior (``policy_state``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvci_plugin.ops._native import untrack_leaf
from kvci_plugin.ops.quiet import untracked
from kvci_plugin.policy.anchor_table import AnchorTable, PolicyClass
from kvci_plugin.policy.offer import COUNT_CAP, Offer
from kvci_plugin.policy.reuse_hazard import EDGES, HazardCounts, ReuseHazard
from kvci_plugin.policy.tier_policy import PolicyStats

# Anchors remembered without their data. One costs ~200 B, so the default bound costs ~13 MB,
# and with the learning it keeps, a tier sees past its own capacity (ARC keeps ghosts of its size).
DEFAULT_MAX_GHOSTS = 65536
# Rates are recomputed after this many lookups, or after an eighth of the tracked anchors' count
# of them when that is more: the refresh reads every tracked anchor's row (``AnchorTable``), so
# its cost per lookup stays bounded.
REFRESH_LOOKUPS = 64
# Victim ages the holding horizon is the median of.
HORIZON_SAMPLES = 64
# Ghosts forgotten past the bound per new anchor at most: a forget or a large eviction can turn
# thousands of held anchors into ghosts at once, and forgetting them all at the next sighting
# held the scheduler thread for milliseconds per thousand. The excess goes over the next
# sightings instead (each adds one ghost and takes up to this many).
FORGET_PER_SIGHTING = 64


_NO_CIDS: tuple[str, ...] = ()


@dataclass(slots=True)
class _Anchor:
    """An anchor's record: a held one's, or a ghost's read from its row for a moment. Its row
    in the ``AnchorTable`` mirrors its fields (each change is written there as it is made), so a
    held anchor becomes a ghost, its row alone, with no write."""

    band: int
    pending: bool | None
    last_seen: float
    cost: float | None
    reuses: int = 0
    # Its held checkpoints, in the order they were admitted: a re-send moves them in that order
    # (a set's order follows the hash of random ids, and made the policy's choices differ run to
    # run). Empty for a ghost, read from its row for a moment (``at``).
    cids: dict[str, None] | tuple[str, ...] = _NO_CIDS
    row: int = -1  # in the policy's ``AnchorTable``

    @classmethod
    def of(cls, offer: Offer, now: float) -> _Anchor:
        return cls(offer.band, offer.pending, now, offer.rebuild_s_per_page)

    @classmethod
    def at(cls, table: AnchorTable, row: int) -> _Anchor:
        """A ghost's fields, read from its row (written back with ``AnchorTable.put``)."""
        return cls(*table.fields(row), row=row)

    def put(self, table: AnchorTable) -> None:
        table.put(self.row, self.band, self.reuses, self.pending, self.last_seen, self.cost)

    @property
    def cls(self) -> PolicyClass:
        return (self.band, min(self.reuses, COUNT_CAP), self.pending)


class ValuePolicy:
    name = "kvci"

    def __init__(
        self, *, max_ghosts: int = DEFAULT_MAX_GHOSTS, hazard: ReuseHazard | None = None
    ) -> None:
        """``hazard``: what the policy weighs by and learns into (default: a fresh one, learned
        online from what the tier sees)."""
        if isinstance(max_ghosts, bool) or not isinstance(max_ghosts, int) or max_ghosts < 0:
            raise ValueError(f"max_ghosts must be an int >= 0, not {max_ghosts!r}")
        self._max_ghosts = max_ghosts
        self._hazard = hazard if hazard is not None else ReuseHazard()
        # Anchors with no checkpoint held (ghosts), least recently seen first, each its row in
        # the table alone; and those with one, each its row, whose record the table keeps
        # (``AnchorTable.held``). The maps by checkpoint and anchor hold ids and row numbers
        # only, never a record: each is a map the garbage collector does not walk (``ops.quiet``),
        # where maps of records were walked whole by every full collection, on the scheduler
        # thread, a pause that grew with the tier.
        self._ghosts: OrderedDict[Hashable, int] = untracked(OrderedDict())
        self._held: dict[Hashable, int] = {}
        self._table = AnchorTable()  # every anchor's fields, in columns (a ghost's only there)
        self._anchor_of: dict[str, Hashable] = {}
        # Held non-explicit checkpoints per class, least recently seen first, each with its
        # anchor's row (an eviction weighs it without looking it up); explicit ones apart.
        self._by_class: dict[PolicyClass, OrderedDict[str, int]] = {}
        self._explicit: OrderedDict[str, None] = untracked(OrderedDict())
        self._unread: set[str] = untracked(set())
        # Checkpoints an order held (retentions): their stay says nothing of the horizon.
        self._ordered: set[str] = untracked(set())
        # Checkpoints already chosen to leave that hold their heads on (``trimmed``) until their
        # context is re-sent: their pages are room an admission already paid for.
        self._leaving: set[str] = untracked(set())
        self._lookups_since_refresh = 0
        self._cost_sum = 0.0
        self._cost_n = 0
        # Idle ages of the latest victims: how long the tier can hold what it admits now.
        self._victim_ages: deque[float] = deque(maxlen=HORIZON_SAMPLES)
        self._horizon_s: float | None = None  # ``_horizon`` until a victim age comes in
        self._admitted = self._admitted_explicit = self._displaced = 0
        self._refused = self._wasted = 0
        # The values ``eviction_order`` weighed at ``now``, for ``admits`` to read back instead
        # of weighing every victim again (a large eviction weighs thousands); any change to
        # what a value depends on drops them.
        self._weighed: tuple[float, dict[str, float]] | None = None

    # ---- learning ----------------------------------------------------------------------------

    def observe_lookup(self, chain: Sequence[Hashable], now: float) -> None:
        self._weighed = None
        for i, row, anchor in self._table.remembered_in(chain):
            if anchor is None:  # a ghost: the least recently seen are forgotten first
                self._ghosts.move_to_end(chain[i])
                anchor = _Anchor.at(self._table, row)
            self._unread.difference_update(anchor.cids)  # held and re-sent: this lookup hits it
            before = anchor.cls
            self._hazard.ended(before, max(0.0, now - anchor.last_seen), reused=True)
            anchor.reuses += 1
            anchor.last_seen = now
            self._table.put_seen(anchor.row, anchor.band, anchor.reuses, anchor.pending, now)
            self._reclass(anchor, before)
        self._lookups_since_refresh += 1
        if self._lookups_since_refresh >= max(REFRESH_LOOKUPS, self.tracked // 8):
            self._refresh(now)

    def sighted(self, offer: Offer, now: float) -> None:
        self._weighed = None
        self._learn_cost(offer.rebuild_s_per_page)
        anchor = self._record(offer.anchor)
        if anchor is not None:
            if offer.rebuild_s_per_page is not None:
                anchor.cost = offer.rebuild_s_per_page
                self._table.put_cost(anchor.row, anchor.cost)
            return
        row = self._ghosts.get(offer.anchor)
        if row is None:
            self._ghosts[offer.anchor] = self._remember(offer.anchor, offer, now).row
            self._forget_overflow(now)
        else:
            # The same context finished again (a repeat): its class follows the latest word on it.
            anchor = _Anchor.at(self._table, row)
            anchor.band, anchor.pending = offer.band, offer.pending
            anchor.cost = (
                offer.rebuild_s_per_page if offer.rebuild_s_per_page is not None else anchor.cost
            )
            anchor.put(self._table)

    def reuse_hazard(self, now: float) -> ReuseHazard:
        """What the policy has learned, with the contexts still idle counted up to ``now``."""
        self._refresh(now)
        return self._hazard

    def learned(self, now: float) -> HazardCounts:
        """What the policy has learned, as counts a restarted tier can start from
        (``ReuseHazard.from_counts``): the contexts still idle count as idle up to ``now``. Their
        idle ages are gathered when first read (``HazardCounts.closed``, on the saver's thread),
        from a copy of the anchors' columns made here (``AnchorTable.idle``), under the index's
        lock."""
        return self._hazard.counts(self._table.idle(now))

    @property
    def tracked(self) -> int:
        return len(self._ghosts) + len(self._held)

    # ---- choices -----------------------------------------------------------------------------

    def eviction_order(self, entries: Mapping[str, Any], now: float) -> Iterator[str]:
        weighed: dict[str, float] = {}
        self._weighed = (now, weighed)
        heads: list[tuple[int, Iterator[tuple[str, int]], str, int]] = []
        classes: list[PolicyClass] = []
        for n, (cls, members) in enumerate(self._by_class.items()):
            it = iter(members.items())
            head = next(it, None)
            if head is not None:
                heads.append((n, it, *head))
                classes.append(cls)
        # Every class's head weighed in one call: each is a candidate before the first victim.
        heap = []
        records = self._table.held_records()
        values = self._values([records[row] for *_, row in heads], classes, now)
        for (n, it, head, _), value in zip(heads, values):
            weighed[head] = value
            heap.append((value, n, it, head))
        heapq.heapify(heap)
        while heap:
            _, n, it, cid = heap[0]
            yield cid
            following = next(it, None)
            if following is None:
                heapq.heappop(heap)
            else:
                cid, row = following
                weighed[cid] = value = self._value_of(records[row], now)
                heapq.heapreplace(heap, (value, n, it, cid))
        yield from self._explicit
        # Checkpoints the policy was never told about (none when the index drives it) go last.
        for cid in entries:
            if cid not in self._anchor_of:
                yield cid

    def admits(self, offer: Offer, victims: Sequence[str], now: float,
               displaced: Collection[str] | None = None) -> bool:
        if not victims:
            return True
        # What the offer would take from the tier: victims whose pages leave with them (a page
        # goes with the last of its holders to go; one every page of which stays, with the
        # offer or another holder, displaces nothing), and not the head of one already chosen
        # to leave (the pages evicting it whole would have left free).
        weighed_against = [cid for cid in victims if cid not in self._leaving
                           and (displaced is None or cid in displaced)]
        if offer.explicit:
            admit = True
        elif any(cid in self._explicit for cid in victims):
            admit = False
        elif not weighed_against:
            admit = True
        else:
            anchor = self._record(offer.anchor)
            row = self._ghosts.get(offer.anchor) if anchor is None else None
            if row is not None:
                anchor = _Anchor.at(self._table, row)
            cls = anchor.cls if anchor is not None else (offer.band, 0, offer.pending)
            worth = self._worth(cls, 0.0) * self._cost(offer.rebuild_s_per_page)
            weighed = self._weighed[1] if self._weighed and self._weighed[0] == now else {}
            admit = worth >= max(weighed[cid] if cid in weighed else self._value(cid, now)
                                 for cid in weighed_against)
        self._weighed = None
        if not admit:
            self._refused += 1
            return False
        # The index evicts them now: how long they were held sets the horizon, unless an order
        # held them (a retention's pins, not the tier's choice, set how long they stayed), or
        # they were counted when they began to leave (a trimmed head leaves piece by piece).
        for cid in victims:
            if cid in self._ordered or cid in self._leaving:
                continue
            anchor = self._record(self._anchor_of.get(cid))
            if anchor is not None:
                self._victim_ages.append(max(0.0, now - anchor.last_seen))
                self._horizon_s = None
        return True

    # ---- what the index did ------------------------------------------------------------------

    def admitted(self, checkpoint_id: str, offer: Offer, now: float) -> None:
        self._weighed = None
        anchor = self._record(offer.anchor)
        if anchor is None:
            row = self._ghosts.pop(offer.anchor, None)
            anchor = (self._remember(offer.anchor, offer, now) if row is None
                      else _Anchor.at(self._table, row))
            self._held[offer.anchor] = anchor.row
            self._table.hold(anchor.row, anchor)
        if anchor.cids:
            anchor.cids[checkpoint_id] = None  # type: ignore[index]
        else:
            anchor.cids = {checkpoint_id: None}  # ids only: a dict the collector does not walk
            untrack_leaf(anchor)  # held as long as its checkpoints: young collections skip it
        self._anchor_of[checkpoint_id] = offer.anchor
        self._unread.add(checkpoint_id)
        self._admitted += 1
        if offer.explicit:
            self._admitted_explicit += 1
            self._explicit[checkpoint_id] = None
        else:
            self._members(anchor.cls)[checkpoint_id] = anchor.row

    def resent_prefix(self, chain: Sequence[Hashable]) -> tuple[int, Offer] | None:
        """The context before the chain's last key that a lookup re-sent most deeply, when it
        holds no checkpoint: its pages are kept as one of its own, weighed by its class."""
        end = len(chain) - 1
        while (found := self._table.last_remembered(chain, end)) is not None:
            pos, row, anchor = found
            if anchor is not None:
                return None  # that context is kept: its checkpoint already holds the prefix
            _, _, _, cost, reuses = self._table.fields(row)
            if reuses:
                return pos + 1, Offer(anchor=chain[pos], rebuild_s_per_page=cost)
            end = pos
        return None

    def trimmed(self, checkpoint_id: str, anchor: Hashable) -> None:
        # It stays weighed as the context it was kept for, where it was in its class: the cut is
        # where room ran out, not a context anyone sent (anchored there, each continuation that
        # passed it counted one more return of its class, and each cut left a ghost behind).
        self._weighed = None
        if checkpoint_id in self._anchor_of:
            self._leaving.add(checkpoint_id)

    def retained(self, checkpoint_id: str) -> None:
        if checkpoint_id in self._anchor_of:
            self._ordered.add(checkpoint_id)

    def touched(self, checkpoint_ids: Sequence[str], now: float) -> None:
        # A hit is counted where the policy learns it: its lookup re-sent the anchor.
        return None

    def dropped(self, checkpoint_id: str, *, evicted: bool) -> None:
        self._weighed = None
        key = self._anchor_of.pop(checkpoint_id, None)
        if evicted:
            self._displaced += 1
            self._wasted += checkpoint_id in self._unread
        self._unread.discard(checkpoint_id)
        self._ordered.discard(checkpoint_id)
        self._leaving.discard(checkpoint_id)
        if key is None:
            return
        anchor = self._table.held(self._held[key])
        anchor.cids.pop(checkpoint_id, None)  # type: ignore[union-attr]
        if self._explicit.pop(checkpoint_id, 0) is not None:
            self._leave_class(checkpoint_id, anchor.cls)
        if not anchor.cids:
            # Still remembered, as a ghost (its row, which mirrors the record): whether it comes
            # back is what the next decision learns from.
            del self._held[key]
            self._table.hold(anchor.row, None)
            self._ghosts[key] = anchor.row

    def cleared(self) -> None:
        self._weighed = None
        # What was learned about the workload stays; the anchors (keys of the old generation) go.
        self._ghosts.clear()
        self._table.clear()
        self._held.clear()
        self._anchor_of.clear()
        self._by_class.clear()
        self._explicit.clear()
        self._unread.clear()
        self._ordered.clear()
        self._leaving.clear()

    def stats(self) -> PolicyStats:
        return PolicyStats(
            policy=self.name, admitted=self._admitted, admitted_explicit=self._admitted_explicit,
            displaced=self._displaced, refused_under_pressure=self._refused,
            evicted_before_hit=self._wasted, tracked_anchors=self.tracked)

    # ---- internals -----------------------------------------------------------------------------

    def _value(self, checkpoint_id: str, now: float) -> float:
        return self._value_of(self._table.held(self._held[self._anchor_of[checkpoint_id]]), now)

    def _value_of(self, anchor: _Anchor, now: float) -> float:
        """``_values`` of one anchor's checkpoint (the same sum, without building lists)."""
        return self._hazard.resend_probability(
            anchor.cls, max(0.0, now - anchor.last_seen), self._horizon()) * self._cost(anchor.cost)

    def _values(self, anchors: Sequence[_Anchor], classes: Sequence[PolicyClass],
                now: float) -> list[float]:
        """The value of checkpoints of these anchors, of these classes (the keys of
        ``_by_class`` they are under): how likely each context, idle as long as it has been, is
        re-sent while the tier could hold it, times its rebuild cost per page."""
        worth = self._hazard.resend_probabilities(
            classes, [max(0.0, now - a.last_seen) for a in anchors], self._horizon())
        unknown = self._cost(None)
        return [w * (unknown if a.cost is None else a.cost) for w, a in zip(worth, anchors)]

    def _worth(self, cls: PolicyClass, age_s: float) -> float:
        """How likely a ``cls`` context idle ``age_s`` is re-sent while the tier could hold it."""
        return self._hazard.resend_probability(cls, age_s, self._horizon())

    def _horizon(self) -> float:
        """How long the tier holds what it admits now: the median idle age of its latest victims
        (Che's characteristic time of an LRU cache, measured); before any eviction, the longest
        idle age the hazard tells apart."""
        if self._horizon_s is None:  # kept: every value an eviction weighs reads it
            ages = self._victim_ages
            self._horizon_s = (max(sorted(ages)[len(ages) // 2], EDGES[1]) if ages
                               else EDGES[-1])
        return self._horizon_s

    def _cost(self, per_page: float | None) -> float:
        if per_page is not None:
            return per_page
        # Unknown: the mean of those known, so a context without a measure is neither favoured
        # nor sacrificed; 1 before any is known (every value then scales alike).
        return self._cost_sum / self._cost_n if self._cost_n else 1.0

    def _learn_cost(self, per_page: float | None) -> None:
        if per_page is not None:
            self._cost_sum += per_page
            self._cost_n += 1

    def _leave_class(self, checkpoint_id: str, cls: PolicyClass) -> None:
        members = self._by_class.get(cls)
        if members is not None:
            members.pop(checkpoint_id, None)
            if not members:
                del self._by_class[cls]

    def _record(self, key: Hashable) -> _Anchor | None:
        """A held anchor's record (None: ``key`` holds no checkpoint)."""
        row = self._held.get(key)
        return None if row is None else self._table.held(row)

    def _members(self, cls: PolicyClass) -> OrderedDict[str, int]:
        members = self._by_class.get(cls)
        if members is None:
            members = self._by_class[cls] = untracked(OrderedDict())
        return members

    def _reclass(self, anchor: _Anchor, before: PolicyClass) -> None:
        """The anchor was just seen: its held checkpoints move to the tail of its (new) class."""
        after = anchor.cls
        self._leaving.difference_update(anchor.cids)  # re-sent: its head proved itself
        for cid in anchor.cids:
            if cid in self._explicit:
                self._explicit.move_to_end(cid)
                continue
            members = self._by_class[before]
            del members[cid]
            if not members:
                del self._by_class[before]
            self._members(after)[cid] = anchor.row

    def _forget_overflow(self, now: float) -> None:
        for _ in range(min(len(self._ghosts) - self._max_ghosts, FORGET_PER_SIGHTING)):
            _, row = self._ghosts.popitem(last=False)
            anchor = _Anchor.at(self._table, row)
            self._table.drop(row)
            self._hazard.ended(anchor.cls, max(0.0, now - anchor.last_seen), reused=False)

    def _refresh(self, now: float) -> None:
        self._weighed = None
        self._lookups_since_refresh = 0
        self._hazard.refresh(self._table.idle(now))

    def _remember(self, key: Hashable, offer: Offer, now: float) -> _Anchor:
        """A new anchor, its row in the table written (a ghost until ``AnchorTable.hold``)."""
        anchor = _Anchor.of(offer, now)
        anchor.row = self._table.add(key)
        anchor.put(self._table)
        return anchor
