"""What the engine remembers of earlier requests, for the observation it makes of a finished one.

Two facts a client rarely sends are measured instead. Its session's context churn: a turn that
does not re-send the session's previous prompt rewrote it; the prompt's blocks are the items the
turn compiled, and those the previous prompt lacked are novel. And ``observed_reuse``, how often
the context was re-sent: in a session, the turns since its context last changed (each re-sent
it, whichever cache served it: vLLM's own prefix cache serves most of a conversation's re-sends,
and kvci's loads never see those); without one, how often the prefix the request loaded was
loaded before (counted per the last key of each hit). Not the larger of the two: a hit on a
shared system prompt says nothing of whether this context comes back, and mixing it in cost
hits at the small budgets (``benchmarks.policy_sim``, conversation trace).
The connector's scheduler keeps one ``RequestHistory``; the policy simulator replays the same one
(``benchmarks/policysim/kvci_tier.py``), so both score what the same history says.

Keys are opaque and hashable (the connector's page keys, the simulator's block ids). Both tables
are bounded, the least recently used entry forgotten first, as a live table must be: at most
``max_tracked`` prefixes and sessions, and at most ``max_keys`` keys of sessions' prompts in all
(session ids are the client's to choose; a prompt's keys are as many as its blocks). With the
connector's 16-byte page keys the default bound holds about 2^20 keys, some 70 MiB at most.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

MAX_TRACKED = 65536  # prefixes whose reuse is counted, and sessions whose context is remembered
MAX_KEYS = 1 << 20  # keys of sessions' previous prompts, over every session
SESSION_WINDOW = 8  # turns over which a session's context rewrites are counted


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """One turn of a session, as its observation reads it."""

    rewrote: bool  # the turn did not re-send the session's previous prompt
    context_rewrites: (
        int  # rewrites over the session's last SESSION_WINDOW turns, this one included
    )
    turns_since_change: int  # 0: the context was created or rewritten by this turn
    retrieved_items: int  # the prompt's blocks
    novel_items: int  # of those, the ones the previous prompt did not hold

    @property
    def kept_items(self) -> int:
        """The prompt's leading blocks that the previous prompt began with too."""
        return self.retrieved_items - self.novel_items


@dataclass(slots=True)
class _Session:
    prefix: tuple[Hashable, ...] = ()
    rewrites: list[bool] = field(default_factory=list)
    turns_since_change: int = 0


@dataclass(frozen=True, slots=True)
class Measured:
    """What the history measures of a finished request."""

    turn: SessionTurn | None  # None: the request named no session
    observed_reuse: int | None  # None: no session and no load to count


class RequestHistory:
    def __init__(self, *, max_tracked: int = MAX_TRACKED, max_keys: int = MAX_KEYS) -> None:
        for name, value in (("max_tracked", max_tracked), ("max_keys", max_keys)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._max = max_tracked
        self._max_keys = max_keys
        self._keys = 0  # keys held in sessions' prefixes
        self._reuse: OrderedDict[Hashable, int] = OrderedDict()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def record_hit(self, key: Hashable) -> None:
        """A request loaded a prefix ending at ``key``."""
        self._reuse[key] = self._reuse.get(key, 0) + 1
        self._reuse.move_to_end(key)
        if len(self._reuse) > self._max:
            self._reuse.popitem(last=False)

    def reuse(self, key: Hashable) -> int:
        """How many loads of the prefix ending at ``key`` are remembered."""
        return self._reuse.get(key, 0)

    def turn(self, session: str, prefix: Sequence[Hashable]) -> SessionTurn:
        """Record ``session``'s turn whose prompt is ``prefix`` (its blocks' keys)."""
        prompt = tuple(prefix)
        s = self._sessions.pop(session, None) or _Session()
        self._keys -= len(s.prefix)
        rewrote = bool(s.prefix) and prompt[: len(s.prefix)] != s.prefix
        shared = next((i for i, (a, b) in enumerate(zip(s.prefix, prompt)) if a != b),
                      min(len(s.prefix), len(prompt)))
        s.rewrites = (s.rewrites + [rewrote])[-SESSION_WINDOW:]
        # A context created this turn has not yet gone a turn unchanged.
        s.turns_since_change = 0 if rewrote or not s.prefix else s.turns_since_change + 1
        # A prompt past the bound is remembered by its leading keys: a rewrite of them is
        # still seen, and a turn that re-sends them still counts as unchanged.
        s.prefix = prompt[: self._max_keys]
        self._keys += len(s.prefix)
        self._sessions[session] = s
        while len(self._sessions) > self._max or self._keys > self._max_keys:
            _, dropped = self._sessions.popitem(last=False)
            self._keys -= len(dropped.prefix)
        return SessionTurn(rewrote=rewrote, context_rewrites=sum(s.rewrites),
                           turns_since_change=s.turns_since_change, retrieved_items=len(prompt),
                           novel_items=len(prompt) - shared)

    def measure(self, session: str | None, prompt: Sequence[Hashable],
                loaded_to: Hashable | None) -> Measured:
        """A finished request: its session's turn (recorded) and the reuse it observed;
        ``loaded_to`` is the last key it loaded, None when it loaded nothing."""
        if session is not None:
            turn = self.turn(session, prompt)
            return Measured(turn, turn.turns_since_change)
        return Measured(None, None if loaded_to is None else self.reuse(loaded_to))

    def forget_contexts(self) -> None:
        """After a cache reset the old keys name nothing: no prefix's reuse is known, and a
        session's next turn is not a rewrite of a context made of them."""
        self._reuse.clear()
        for session in self._sessions.values():
            session.prefix = ()
        self._keys = 0

    @property
    def keys_held(self) -> int:
        """Keys of sessions' previous prompts held now (at most ``max_keys``)."""
        return self._keys
