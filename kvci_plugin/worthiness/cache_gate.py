"""Whether the autonomous (system) trigger may store a checkpoint right now.

Applies to the system trigger only: a user's or agent's explicit "checkpoint now" is never
paused by it. Rules run top-down and the first match wins; when none matches, the store is
allowed. Every decision records the matching rule with its inputs and every rule evaluated on
the way, so "why was nothing stored?" has an answer:

1. ``kill_switch``: autonomous stores switched off by the operator.
2. ``hit_rate_floor``: over the last ``hit_rate_window`` tier lookups, fewer than
   ``hit_rate_floor`` hit: stores are not paying back (each one spends copy bandwidth and
   evicts an older entry to hold something nobody reads). No decision before ``min_lookups``.
3. ``churn``: the session's context changed ``churn_threshold`` times within ``churn_window_s``:
   a checkpoint would be superseded before it could be reused. What every change kept is not
   superseded, though: ``churn_keeps`` says how much of the prompt a churn pause still offers.

While the floor pauses autonomous stores they cannot earn hits, so the pause would never lift;
after ``hit_rate_retry_after`` refusals in a row the lookup window restarts, and stores resume
until the new window has ``min_lookups`` lookups to judge them by.

Decisions carry numbers only (no session ids): the caller knows which session it asked about.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from enum import Enum

from pydantic import BaseModel, ConfigDict, JsonValue

from kvci_plugin.worthiness.request_history import SessionTurn

# Break-even for a paid prompt cache is ~25 % hits (where the reads a write serves pay back its
# premium); a tier that evicts to store pays a similar price, and the margin above it keeps the
# gate from flapping around break-even.
HIT_RATE_FLOOR = 0.30
HIT_RATE_WINDOW = 64
MIN_LOOKUPS = 16
CHURN_WINDOW_S = 300.0
# With a window of five minutes, three context changes mean the session is reshaping its
# context faster than a checkpoint is reused.
CHURN_THRESHOLD = 3
MAX_TRACKED_SESSIONS = 4096


class CacheGateRule(str, Enum):
    KILL_SWITCH = "kill_switch"
    HIT_RATE_FLOOR = "hit_rate_floor"
    CHURN = "churn"
    DEFAULT = "default"


ENGINE_WIDE_INPUTS = ("lookups", "hits", "hit_rate")
"""Inputs of the hit-rate rule that count every tenant's lookups (left out of a client's reply)."""


class RuleEvaluation(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: CacheGateRule
    matched: bool
    inputs: dict[str, JsonValue]


class CacheGateDecision(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    allow: bool
    rule: CacheGateRule
    inputs: dict[str, JsonValue]
    # The rules evaluated, in order, up to and including the one that matched.
    evaluated: tuple[RuleEvaluation, ...]


def churn_keeps(decision: CacheGateDecision, turn: SessionTurn | None) -> int:
    """How many of the prompt's leading blocks the system trigger still offers when ``decision``
    paused it; 0: none.

    Only a pause by churn is narrowed, and only for a turn that rewrote the context: to the blocks
    it re-sent from the session's previous prompt (``turn.kept_items``). What the changes rewrote
    would be superseded, but what they kept (a system prompt and tools shared by every rewrite,
    say) the next one is likely to keep too. Paused whole with the rest, that prefix was lost once
    its holders were evicted and never stored again: on the mixed trace keyed by its first
    blocks kvci then saved a fraction of what LRU saved (``benchmarks.policy_sim
    --session-keyed``; the current figures: benchmarks/results/README.md,
    policy_sim_hiverge_keyed).
    A turn that only extended its previous prompt in a churning session is paused whole: its
    shared part is the last turn's, not what the rewrites kept. The kill switch and the hit-rate
    floor pause everything."""
    if (
        decision.allow
        or decision.rule is not CacheGateRule.CHURN
        or turn is None
        or not turn.rewrote
    ):
        return 0
    return turn.kept_items


class CacheGate:
    def __init__(
        self,
        *,
        kill_switch: bool = False,
        hit_rate_floor: float = HIT_RATE_FLOOR,
        hit_rate_window: int = HIT_RATE_WINDOW,
        min_lookups: int = MIN_LOOKUPS,
        hit_rate_retry_after: int = HIT_RATE_WINDOW,
        churn_window_s: float = CHURN_WINDOW_S,
        churn_threshold: int = CHURN_THRESHOLD,
        max_tracked_sessions: int = MAX_TRACKED_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(kill_switch, bool):
            raise TypeError(f"kill_switch must be a bool, got {type(kill_switch).__name__}")
        _require_number("hit_rate_floor", hit_rate_floor, 0.0, 1.0)
        _require_int("hit_rate_window", hit_rate_window, 1)
        _require_int("min_lookups", min_lookups, 1)
        if min_lookups > hit_rate_window:
            raise ValueError(
                f"min_lookups ({min_lookups}) cannot exceed hit_rate_window ({hit_rate_window})"
            )
        _require_int("hit_rate_retry_after", hit_rate_retry_after, 1)
        _require_number("churn_window_s", churn_window_s, 0.0, math.inf)
        if churn_window_s <= 0.0:
            raise ValueError(f"churn_window_s must be > 0, got {churn_window_s!r}")
        _require_int("churn_threshold", churn_threshold, 1)
        _require_int("max_tracked_sessions", max_tracked_sessions, 1)
        if not callable(clock):
            raise TypeError("clock must be callable")
        self._lock = threading.Lock()
        self._kill_switch = kill_switch
        self._hit_rate_floor = float(hit_rate_floor)
        self._min_lookups = min_lookups
        self._hit_rate_retry_after = hit_rate_retry_after
        self._churn_window_s = float(churn_window_s)
        self._churn_threshold = churn_threshold
        self._max_tracked_sessions = max_tracked_sessions
        self._clock = clock
        self._lookups: deque[bool] = deque(maxlen=hit_rate_window)
        self._floor_refusals = 0
        self._changes: OrderedDict[str, deque[float]] = OrderedDict()

    @property
    def kill_switch(self) -> bool:
        return self._kill_switch

    def set_kill_switch(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        with self._lock:
            self._kill_switch = enabled

    def record_lookup(self, hit: bool) -> None:
        """One tier lookup (a request looking for its prefix in RAM or disk) and its outcome."""
        if not isinstance(hit, bool):
            raise TypeError(f"hit must be a bool, got {type(hit).__name__}")
        with self._lock:
            self._lookups.append(hit)

    def record_context_change(self, session_id: str) -> None:
        """The session's context was rewritten (its prefix diverged from the previous request's)."""
        _require_session(session_id)
        now = self._clock()
        with self._lock:
            changes = self._changes.get(session_id)
            if changes is None:
                changes = self._changes[session_id] = deque()
                if len(self._changes) > self._max_tracked_sessions:
                    self._changes.popitem(last=False)
            else:
                self._changes.move_to_end(session_id)
            changes.append(now)
            self._expire(changes, now)

    def hit_rate(self) -> float | None:
        with self._lock:
            return sum(self._lookups) / len(self._lookups) if self._lookups else None

    def decide(self, session_id: str | None = None) -> CacheGateDecision:
        """May the system trigger store a checkpoint for ``session_id`` now?"""
        if session_id is not None:
            _require_session(session_id)
        now = self._clock()
        with self._lock:
            evaluated: list[RuleEvaluation] = []
            for rule, check in (
                (CacheGateRule.KILL_SWITCH, self._kill_switch_rule),
                (CacheGateRule.HIT_RATE_FLOOR, self._hit_rate_rule),
                (CacheGateRule.CHURN, lambda: self._churn_rule(session_id, now)),
            ):
                matched, inputs = check()
                evaluated.append(RuleEvaluation(rule=rule, matched=matched, inputs=inputs))
                if matched:
                    return CacheGateDecision(
                        allow=False, rule=rule, inputs=inputs, evaluated=tuple(evaluated)
                    )
            evaluated.append(RuleEvaluation(rule=CacheGateRule.DEFAULT, matched=True, inputs={}))
            return CacheGateDecision(
                allow=True, rule=CacheGateRule.DEFAULT, inputs={}, evaluated=tuple(evaluated)
            )

    def _kill_switch_rule(self) -> tuple[bool, dict[str, JsonValue]]:
        return self._kill_switch, {"kill_switch": self._kill_switch}

    def _hit_rate_rule(self) -> tuple[bool, dict[str, JsonValue]]:
        lookups = len(self._lookups)
        hits = sum(self._lookups)
        inputs: dict[str, JsonValue] = {
            "lookups": lookups,
            "hits": hits,
            "hit_rate": hits / lookups if lookups else None,
            "floor": self._hit_rate_floor,
            "window": self._lookups.maxlen,
            "min_lookups": self._min_lookups,
        }
        if lookups < self._min_lookups or hits / lookups >= self._hit_rate_floor:
            self._floor_refusals = 0
            return False, inputs
        self._floor_refusals += 1
        inputs["refusals_in_a_row"] = self._floor_refusals
        if self._floor_refusals >= self._hit_rate_retry_after:
            # This refusal is the last of the pause: the next decisions start a new window.
            self._lookups.clear()
            self._floor_refusals = 0
            inputs["window_restarted"] = True
        return True, inputs

    def _churn_rule(self, session_id: str | None, now: float) -> tuple[bool, dict[str, JsonValue]]:
        inputs: dict[str, JsonValue] = {
            "session_known": session_id is not None,
            "changes_in_window": 0,
            "window_s": self._churn_window_s,
            "threshold": self._churn_threshold,
        }
        changes = self._changes.get(session_id) if session_id is not None else None
        if changes is None:
            return False, inputs
        self._expire(changes, now)
        inputs["changes_in_window"] = len(changes)
        return len(changes) >= self._churn_threshold, inputs

    def _expire(self, changes: deque[float], now: float) -> None:
        while changes and changes[0] <= now - self._churn_window_s:
            changes.popleft()


def _require_session(session_id: object) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")


def _require_number(field: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{field} must be a number, got {type(value).__name__}")
    if math.isnan(value) or not low <= value <= high or math.isinf(value):
        raise ValueError(f"{field} must be finite and in [{low}, {high}], got {value!r}")


def _require_int(field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
