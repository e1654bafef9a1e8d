"""A RAM admission bar that follows the tier's pressure.

The advisor's RAM threshold is one number for every budget, but a small tier should be choosier
and a roomy one should admit more. ``PressureAwareAdmission`` holds the bar the advisor applies
(``CheckpointAdvisor.recommend(observation, ram_threshold=rule.threshold)``) and moves it with
the tier's two kinds of mistake, as ARC moves its target with its ghost lists:

- a wasted write: an admitted checkpoint was evicted before any lookup hit it (the tier paid the
  copy and the room for nothing): the bar rises one step;
- a missed reuse: a lookup extends a checkpoint that the bar alone held back (a lower bar would
  have admitted it) beyond what the tier holds: the bar falls one step.

A held-back checkpoint is remembered (anchor and size, no data) only until later held-back ones
add up to the tier's capacity, so a reuse counts as missed only if it came soon enough that the
tier could have kept it. The bar settles, between its bounds, where a checkpoint scored at the
bar is as likely to be evicted unused as to be wanted in time: a small tier evicts sooner, so
its bar rises; a roomy one keeps checkpoints until their reuse, so its bar falls. Both mistakes
cost: a wasted write spends copy bandwidth and evicts something, a missed reuse spends a
prefill. Everything that moves the bar is known at decision time. Vetoes, the self-report rule
and "no evidence" are the advisor's and block at any bar; the disk rule is untouched (the bar
never exceeds the disk threshold).

A checkpoint is tracked by its anchor: the deepest key that a continuation re-sends (for an
engine, the key of the prompt's last full block). Keys are any hashable values.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvci_plugin.worthiness import CheckpointAdvisor, CheckpointRecommendation

K = TypeVar("K", bound=Hashable)

# The lowest bar: below it the evidence leans clearly against keeping the context (e.g. a
# first turn of a few thousand tokens scores ~0.2-0.3 on engine-measured signals), and however
# roomy the tier, admitting it spends copy bandwidth on what is rarely reused.
DEFAULT_MIN_THRESHOLD = 0.30
# One mistake moves the bar by 0.01: tens of mistakes of one kind move it materially, one
# burst does not swing it across its range.
DEFAULT_STEP = 0.01
# Bound on the admitted checkpoints and held-back anchors tracked at once.
DEFAULT_MAX_TRACKED = 65536


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    threshold: float
    wasted_writes: int
    missed_reuses: int
    # Admitted checkpoints that a lookup hit before they were evicted.
    paid_writes: int
    tracked_admitted: int
    tracked_held_back: int


class _Ghosts(Generic[K]):
    """Anchors with sizes, oldest first, bounded in total bytes and in count."""

    def __init__(self, capacity_bytes: int, max_tracked: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_tracked = max_tracked
        self._sizes: OrderedDict[K, int] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, anchor: K, nbytes: int) -> None:
        self.pop(anchor)
        self._sizes[anchor] = nbytes
        self._bytes += nbytes
        while self._sizes and (
            self._bytes > self.capacity_bytes or len(self._sizes) > self.max_tracked
        ):
            _, size = self._sizes.popitem(last=False)
            self._bytes -= size

    def pop(self, anchor: K) -> bool:
        size = self._sizes.pop(anchor, None)
        if size is None:
            return False
        self._bytes -= size
        return True


class PressureAwareAdmission(Generic[K]):
    """Not thread-safe: the caller serialises calls (the connector's scheduler thread does)."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        initial_threshold: float,
        max_threshold: float,
        min_threshold: float = DEFAULT_MIN_THRESHOLD,
        step: float = DEFAULT_STEP,
        max_tracked: int = DEFAULT_MAX_TRACKED,
    ) -> None:
        _require_int("capacity_bytes", capacity_bytes)
        _require_int("max_tracked", max_tracked)
        for name, value in (
            ("initial_threshold", initial_threshold),
            ("max_threshold", max_threshold),
            ("min_threshold", min_threshold),
            ("step", step),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if not min_threshold <= initial_threshold <= max_threshold:
            raise ValueError(
                f"need min_threshold <= initial_threshold <= max_threshold, got "
                f"{min_threshold!r} <= {initial_threshold!r} <= {max_threshold!r}"
            )
        self.capacity_bytes = capacity_bytes
        self.min_threshold = float(min_threshold)
        self.max_threshold = float(max_threshold)
        self.step = float(step)
        self.max_tracked = max_tracked
        self._threshold = float(initial_threshold)
        # Admitted and not yet hit, oldest first.
        self._admitted: OrderedDict[K, None] = OrderedDict()
        self._held_back: _Ghosts[K] = _Ghosts(capacity_bytes, max_tracked)
        self._wasted = self._missed = self._paid = 0

    @classmethod
    def for_advisor(
        cls,
        advisor: CheckpointAdvisor,
        *,
        capacity_bytes: int,
        min_threshold: float = DEFAULT_MIN_THRESHOLD,
        step: float = DEFAULT_STEP,
        max_tracked: int = DEFAULT_MAX_TRACKED,
    ) -> PressureAwareAdmission[K]:
        """A bar that starts at the advisor's RAM threshold and never exceeds its disk threshold."""
        if not isinstance(advisor, CheckpointAdvisor):
            raise TypeError(f"advisor must be a CheckpointAdvisor, got {type(advisor).__name__}")
        return cls(
            capacity_bytes=capacity_bytes,
            initial_threshold=advisor.ram_threshold,
            max_threshold=advisor.disk_threshold,
            min_threshold=min_threshold,
            step=step,
            max_tracked=max_tracked,
        )

    @property
    def threshold(self) -> float:
        """The RAM threshold to score the next request with."""
        return self._threshold

    def observe_lookup(self, keys: Sequence[K], resident: int) -> None:
        """A request looked up its prefix ``keys``; the first ``resident`` of them were in the tier.

        Call it before the request's own admission, so a request never counts as reusing itself.
        """
        if (
            isinstance(resident, bool)
            or not isinstance(resident, int)
            or not 0 <= resident <= len(keys)
        ):
            raise ValueError(f"resident must be an int in [0, {len(keys)}], got {resident!r}")
        for key in keys[:resident]:
            if key in self._admitted:
                del self._admitted[key]
                self._paid += 1
        missed = False
        for key in keys[resident:]:
            missed |= self._held_back.pop(key)
        # One request is one missed reuse, however many held-back turns of its context it extends.
        if missed:
            self._missed += 1
            self._threshold = max(self.min_threshold, self._threshold - self.step)

    def admitted(self, anchor: K) -> None:
        """The tier stored a checkpoint whose continuation re-sends ``anchor``."""
        self._held_back.pop(anchor)
        self._admitted[anchor] = None
        self._admitted.move_to_end(anchor)
        if len(self._admitted) > self.max_tracked:
            self._admitted.popitem(last=False)

    def declined(self, anchor: K, nbytes: int, recommendation: CheckpointRecommendation) -> None:
        """The tier did not store this checkpoint. Remembered only when the bar alone held it back
        and it scored at least the lowest bar (no bar this rule can set would admit it
        otherwise)."""
        _require_int("nbytes", nbytes, minimum=0)
        if not isinstance(recommendation, CheckpointRecommendation):
            raise TypeError(
                "recommendation must be a CheckpointRecommendation, got "
                f"{type(recommendation).__name__}"
            )
        score = recommendation.score
        if (
            recommendation.held_back_by_threshold
            and score is not None
            and score >= self.min_threshold
        ):
            self._held_back.add(anchor, nbytes)

    def evicted(self, keys: Iterable[K]) -> None:
        """The tier evicted these keys; an admitted anchor among them was never hit: a wasted
        write."""
        for key in keys:
            if key in self._admitted:
                del self._admitted[key]
                self._wasted += 1
                self._threshold = min(self.max_threshold, self._threshold + self.step)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            threshold=self._threshold,
            wasted_writes=self._wasted,
            missed_reuses=self._missed,
            paid_writes=self._paid,
            tracked_admitted=len(self._admitted),
            tracked_held_back=len(self._held_back),
        )


def _require_int(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
