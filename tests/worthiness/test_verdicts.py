"""PublishedVerdicts: the latest verdict per (tenant, session), bounded, safe across threads."""

from __future__ import annotations

import threading

import pytest

from kvci_plugin.worthiness import PublishedVerdicts


def test_the_latest_verdict_wins_and_tenants_do_not_share_a_session() -> None:
    verdicts = PublishedVerdicts()
    verdicts.publish("acme", "s", {"n": 1})
    verdicts.publish("acme", "s", {"n": 2})
    verdicts.publish("beta", "s", {"n": 3})
    acme, beta = verdicts.latest("acme", "s"), verdicts.latest("beta", "s")
    assert acme is not None and beta is not None
    assert (acme.kvci, beta.kvci) == ({"n": 2}, {"n": 3})
    assert acme.finished_at <= beta.finished_at
    assert verdicts.latest("gamma", "s") is None and verdicts.latest("acme", "t") is None


def test_the_least_recently_published_session_goes_first() -> None:
    verdicts = PublishedVerdicts(max_sessions=2)
    verdicts.publish("acme", "a", {})
    verdicts.publish("acme", "b", {})
    verdicts.publish("acme", "a", {"again": True})  # a is the most recent now
    verdicts.publish("acme", "c", {})
    assert verdicts.latest("acme", "b") is None
    assert [verdicts.latest("acme", s) is not None for s in "ac"] == [True, True]


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PublishedVerdicts(max_sessions=0)


def test_concurrent_publishers_keep_the_bound() -> None:
    verdicts = PublishedVerdicts(max_sessions=50)

    def publish(worker: int) -> None:
        for i in range(2000):
            verdicts.publish("acme", f"{worker}-{i % 200}", {"i": i})
            verdicts.latest("acme", f"{worker}-{(i * 7) % 200}")

    threads = [threading.Thread(target=publish, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [verdicts.latest("acme", f"{w}-{i}") for w in range(4) for i in range(200)]
    assert sum(v is not None for v in held) == 50
