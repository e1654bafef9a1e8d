"""RequestHistory: the reuse counts and session turns an observation of a finished request reads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvci_plugin.worthiness import RequestHistory, SessionTurn
from kvci_plugin.worthiness.request_history import SESSION_WINDOW, Measured


def test_a_hit_is_counted_for_the_key_it_ended_at_only() -> None:
    history = RequestHistory()
    assert history.reuse("a") == 0
    history.record_hit("a")
    history.record_hit("a")
    history.record_hit("b")
    assert (history.reuse("a"), history.reuse("b"), history.reuse("c")) == (2, 1, 0)


def test_the_least_recently_hit_prefix_is_forgotten_first() -> None:
    history = RequestHistory(max_tracked=2)
    history.record_hit("a")
    history.record_hit("b")
    history.record_hit("a")  # "b" is now the older
    history.record_hit("c")
    assert (history.reuse("a"), history.reuse("b"), history.reuse("c")) == (2, 0, 1)


def test_a_turn_that_resends_the_previous_prompt_extends_it_and_one_that_does_not_rewrites_it() -> (
    None
):
    history = RequestHistory()
    assert history.turn("s", [1, 2]) == SessionTurn(False, 0, 0, 2, 2)
    assert history.turn("s", [1, 2, 3]) == SessionTurn(False, 0, 1, 3, 1)
    assert history.turn("s", [1, 2, 3, 4, 5]) == SessionTurn(False, 0, 2, 5, 2)
    # Diverges after block 1: a rewrite, and everything after the divergence is novel.
    assert history.turn("s", [1, 9, 3]) == SessionTurn(True, 1, 0, 3, 2)
    assert history.turn("other", [1, 9, 3]) == SessionTurn(False, 0, 0, 3, 3)


def test_rewrites_are_counted_over_the_last_turns_of_the_window() -> None:
    history = RequestHistory()
    history.turn("s", [0])
    for i in range(1, 4):  # three rewrites
        assert history.turn("s", [i]).context_rewrites == i
    for n in range(4, 4 + SESSION_WINDOW):  # extending turns push them out of the window
        turn = history.turn("s", [3] + list(range(100, 100 + n)))
    assert turn.context_rewrites == 0 and not turn.rewrote


def test_after_forget_contexts_no_reuse_is_known_and_the_next_turn_is_no_rewrite() -> None:
    history = RequestHistory()
    history.record_hit("a")
    history.turn("s", [1, 2])
    history.turn("s", [7])  # a rewrite
    history.forget_contexts()
    assert history.reuse("a") == 0
    turn = history.turn("s", [5, 6])
    assert not turn.rewrote and turn.novel_items == 2 and turn.context_rewrites == 1


def test_a_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tracked"):
        RequestHistory(max_tracked=0)


@given(
    st.lists(
        st.tuples(st.sampled_from("xyz"), st.lists(st.integers(0, 3), max_size=6)), max_size=30
    )
)
def test_turns_match_a_reference_model(turns: list[tuple[str, list[int]]]) -> None:
    history = RequestHistory()
    last: dict[str, tuple[int, ...]] = {}
    flags: dict[str, list[bool]] = {}
    unchanged: dict[str, int] = {}
    for session, prompt in turns:
        prev = last.get(session, ())
        rewrote = bool(prev) and tuple(prompt[: len(prev)]) != prev
        shared = 0
        while shared < min(len(prev), len(prompt)) and prev[shared] == prompt[shared]:
            shared += 1
        flags[session] = (flags.get(session, []) + [rewrote])[-SESSION_WINDOW:]
        unchanged[session] = 0 if rewrote or not prev else unchanged.get(session, 0) + 1
        last[session] = tuple(prompt)
        assert history.turn(session, prompt) == SessionTurn(
            rewrote, sum(flags[session]), unchanged[session], len(prompt), len(prompt) - shared)


def test_in_a_session_the_observed_reuse_is_the_turns_that_resent_its_context() -> None:
    history = RequestHistory()
    history.record_hit("k")
    history.record_hit("k")
    first = history.measure("s", [1, 2], loaded_to="k")
    assert (
        first.turn is not None and first.observed_reuse == 0
    )  # a shared prefix's hits say nothing
    assert history.measure("s", [1, 2, 3], loaded_to=None).observed_reuse == 1  # vLLM served it
    assert history.measure("s", [1, 2, 3, 4], loaded_to="k").observed_reuse == 2
    assert history.measure("s", [9], loaded_to=None).observed_reuse == 0  # rewritten: a new context


def test_without_a_session_the_observed_reuse_is_the_loads_of_the_prefix_it_loaded() -> None:
    history = RequestHistory()
    history.record_hit("k")
    assert history.measure(None, [1, 2], loaded_to="k") == Measured(None, 1)
    assert history.measure(None, [1, 2], loaded_to=None) == Measured(None, None)


def test_the_keys_sessions_hold_are_bounded_oldest_session_forgotten_first() -> None:
    history = RequestHistory(max_keys=100)
    for s in range(10):  # client-chosen session ids, 30 blocks each: 300 keys asked to be held
        history.turn(f"s{s}", [(s, i) for i in range(30)])
        assert history.keys_held <= 100
    assert history.keys_held == 90  # the three newest sessions
    # The newest session is remembered: re-sent, its context is unchanged...
    assert not history.turn("s9", [(9, i) for i in range(31)]).rewrote
    # ...the oldest is not: its next turn starts a new context, as a first turn does.
    first = history.turn("s0", [(0, i) for i in range(31)])
    assert not first.rewrote and first.turns_since_change == 0


def test_a_prompt_longer_than_the_bound_is_remembered_by_its_leading_keys() -> None:
    history = RequestHistory(max_keys=8)
    history.turn("s", list(range(20)))
    assert history.keys_held == 8
    assert not history.turn("s", list(range(25))).rewrote  # re-sends it
    assert history.turn("s", [99, *range(1, 25)]).rewrote  # rewrites its first block


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_bad_key_bound_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_keys"):
        RequestHistory(max_keys=bad)  # type: ignore[arg-type]
