"""PublishedVerdicts: the latest verdict per (tenant, session), bounded per tenant and in all,
and a verdict published under a verified credential readable only with one."""

from __future__ import annotations

import pytest

from kvci_plugin.worthiness import PublishedVerdicts


def test_the_latest_verdict_wins_and_tenants_do_not_share_a_session() -> None:
    verdicts = PublishedVerdicts()
    verdicts.publish("acme", "s", {"n": 1}, verified=False)
    verdicts.publish("acme", "s", {"n": 2}, verified=False)
    verdicts.publish("beta", "s", {"n": 3}, verified=False)
    acme, beta = (
        verdicts.latest("acme", "s", verified=False),
        verdicts.latest("beta", "s", verified=True),
    )
    assert acme is not None and beta is not None
    assert (acme.kvci, beta.kvci) == ({"n": 2}, {"n": 3})
    assert verdicts.latest("gamma", "s", verified=True) is None
    assert verdicts.latest("acme", "t", verified=True) is None


def test_a_verified_verdict_needs_a_verified_reader() -> None:
    verdicts = PublishedVerdicts()
    verdicts.publish("acme", "s", {"tier": "ram"}, verified=True)
    assert verdicts.latest("acme", "s", verified=False) is None
    found = verdicts.latest("acme", "s", verified=True)
    assert found is not None and found.verified and found.kvci == {"tier": "ram"}


def test_a_reader_gets_a_copy() -> None:
    verdicts = PublishedVerdicts()
    published = {"recommendation": {"signals": [1, 2]}}
    verdicts.publish("acme", "s", published, verified=False)
    published["recommendation"]["signals"].append(3)
    first = verdicts.latest("acme", "s", verified=False)
    assert first is not None and first.kvci == {"recommendation": {"signals": [1, 2]}}
    first.kvci["recommendation"]["signals"].clear()
    again = verdicts.latest("acme", "s", verified=False)
    assert again is not None and again.kvci["recommendation"]["signals"] == [1, 2]


def test_the_least_recently_published_session_goes_first() -> None:
    verdicts = PublishedVerdicts(max_sessions=2, max_per_tenant=2)
    verdicts.publish("acme", "a", {}, verified=False)
    verdicts.publish("acme", "b", {}, verified=False)
    verdicts.publish("acme", "a", {"again": True}, verified=False)  # a is the most recent now
    verdicts.publish("beta", "c", {}, verified=False)
    assert verdicts.latest("acme", "b", verified=False) is None
    assert [
        verdicts.latest(t, s, verified=False) is not None for t, s in (("acme", "a"), ("beta", "c"))
    ] == [True, True]


def test_one_tenants_many_sessions_do_not_push_out_the_others() -> None:
    verdicts = PublishedVerdicts(max_sessions=10, max_per_tenant=4)
    verdicts.publish("acme", "kept", {"tier": "ram"}, verified=False)
    for i in range(100):
        verdicts.publish("flood", f"s{i}", {}, verified=False)
    assert verdicts.latest("acme", "kept", verified=False) is not None
    held = [i for i in range(100) if verdicts.latest("flood", f"s{i}", verified=False) is not None]
    assert held == [96, 97, 98, 99]


@pytest.mark.parametrize(("total", "per_tenant"), [(0, 0), (4, 0), (4, 5)])
def test_bad_bounds_are_refused(total: int, per_tenant: int) -> None:
    with pytest.raises(ValueError, match="max_per_tenant"):
        PublishedVerdicts(max_sessions=total, max_per_tenant=per_tenant)
