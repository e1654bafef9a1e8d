"""The REST control surface in process: each action on a real checkpoint manager, the gate's
refusals recorded for `explain`, stable error codes, the body cap and the bearer check. The
client bears the operator token unless a test says otherwise (test_control_access.py holds the
per-role rules, on a real server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from control_support import OPERATOR_TOKEN, TENANT_TOKEN, control_app, control_client
from starlette.testclient import TestClient

from kvci_plugin.api.app import DEFAULT_MAX_BODY_BYTES
from kvci_plugin.api.schema import ENDPOINT
from kvci_plugin.policy.admission import PressureAwareAdmission
from kvci_plugin.tiering.types import CheckpointFencedError
from kvci_plugin.worthiness import CheckpointObservation


@pytest.fixture
def client(world: Any) -> TestClient:
    return control_client(world.plane)


def post(client: TestClient, **body: Any) -> Any:
    return client.post(ENDPOINT, json=body)


def signal(recommendation: dict[str, Any], name: str) -> float | None:
    (found,) = [s for s in recommendation["signals"] if s["name"] == name]
    return found["value"]


# ---- recommend -----------------------------------------------------------------------------------

BUNDLE = {"claims": [{"id": "c1", "evidence": ["doc#1"]}, {"id": "c2", "evidence": []}]}


def test_recommend_derives_from_bundles_and_explicit_fields_win(client: TestClient) -> None:
    derived = post(client, action="recommend", evidence_bundle_json=BUNDLE).json()
    assert signal(derived["recommendation"], "grounding_density") == pytest.approx(
        0.5
    )  # 1 span, 2 claims

    explicit = post(client, action="recommend", evidence_bundle_json=BUNDLE,
                    observation_json={"evidence_spans": 2}).json()
    assert signal(explicit["recommendation"], "grounding_density") == pytest.approx(1.0)

    # An explicit null means "not measured": it does not erase what the bundle measured.
    null = post(client, action="recommend", evidence_bundle_json=BUNDLE,
                observation_json={"evidence_spans": None}).json()
    assert signal(null["recommendation"], "grounding_density") == pytest.approx(0.5)


def test_recommend_renders_the_advisory_only_when_worth_it(client: TestClient) -> None:
    empty = post(client, action="recommend").json()
    assert empty["recommendation"]["tier"] == "none" and empty["advisory"] == ""

    worthy = post(client, action="recommend", observation_json={
        "context_tokens": 60000, "tool_calls": 12, "retrievals": 8, "wall_time_s": 240.0,
        "evidence_spans": 9, "claims": 3, "contradictions_unresolved": 0,
        "contradictions_high_severity": 0, "phase": "plan", "phase_completed": True}).json()
    assert worthy["recommendation"]["tier"] in ("ram", "disk")
    assert worthy["advisory"].startswith("KV-CHECKPOINT ADVISORY")


def observation(wall_time_s: float) -> dict[str, Any]:
    """Scores 0.50 at 3 s and 0.57 at 6 s (rebuild cost; nothing reused)."""
    return {"context_tokens": 229, "output_tokens": 4, "cached_tokens": 0, "observed_reuse": 0,
            "wall_time_s": wall_time_s}


def wasted_writes(bar: PressureAwareAdmission[bytes], n: int) -> None:
    """`n` system checkpoints evicted before any hit."""
    for i in range(n):
        anchor = f"wasted-{i}".encode()
        bar.admitted(anchor)
        bar.evicted([anchor])


def missed_reuses(world: Any, bar: PressureAwareAdmission[bytes], n: int) -> None:
    """`n` lookups of a prefix the bar alone held back (scoring 0.33 at a bar >= 0.44)."""
    held_back = world.manager.advisor.recommend(CheckpointObservation(**observation(1.0)),
                                                ram_threshold=bar.threshold)
    assert held_back.held_back_by_threshold and held_back.score is not None
    for _ in range(n):
        bar.declined(b"held-back", 4 * 256, held_back)
        bar.observe_lookup([b"held-back"], 0)


def advise(client: TestClient, action: str, wall_time_s: float) -> dict[str, Any]:
    extra = {"session_id": "bar-1"} if action == "checkpoint_now" else {}
    rec: dict[str, Any] = post(client, action=action, observation_json=observation(wall_time_s),
                               **extra).json()["recommendation"]
    return rec


@pytest.mark.parametrize("action", ["recommend", "checkpoint_now"])
def test_advice_is_scored_at_the_engines_moving_bar(
    client: TestClient, world: Any, action: str
) -> None:
    fixed = world.manager.advisor.ram_threshold
    at_rest = advise(client, action, 6.0)
    assert (at_rest["ram_threshold"], at_rest["tier"]) == (fixed, "ram")  # 0.57 over 0.55

    bar = world.moving_bar()
    wasted_writes(bar, 3)
    assert bar.threshold == pytest.approx(fixed + 0.03)
    raised = advise(client, action, 6.0)
    assert (raised["ram_threshold"], raised["tier"], raised["score"]) == (
        bar.threshold,
        "none",
        at_rest["score"],
    )

    missed_reuses(world, bar, 11)
    assert bar.threshold == pytest.approx(fixed - 0.08)
    lowered = advise(client, action, 3.0)
    assert lowered["score"] == pytest.approx(0.50)  # under the advisor's own 0.55
    assert (lowered["ram_threshold"], lowered["tier"]) == (bar.threshold, "ram")
    assert not any("ram threshold" in blocker for blocker in lowered["blockers"])


def test_ram_stats_shows_the_admission_bar(client: TestClient, world: Any) -> None:
    fixed = post(client, action="ram_stats").json()["stats"]["admission"]
    assert fixed == {"mode": "fixed", "threshold": world.manager.advisor.ram_threshold,
                     "wasted_writes": None, "missed_reuses": None, "paid_writes": None}

    bar = world.moving_bar()
    wasted_writes(bar, 2)
    missed_reuses(world, bar, 5)
    bar.admitted(b"paid")
    bar.observe_lookup([b"paid"], 1)  # a hit before any eviction: the write paid
    stats = post(client, action="ram_stats").json()["stats"]["admission"]
    assert stats == {"mode": "pressure", "threshold": bar.threshold, "wasted_writes": 2,
                     "missed_reuses": 5, "paid_writes": 1}
    assert stats["threshold"] == advise(client, "recommend", 3.0)["ram_threshold"]


def test_recommend_refuses_an_observation_that_does_not_compose(client: TestClient) -> None:
    # Two novel items derived from the bundle, but the caller's explicit count says one item.
    bundle = {"items": [{"id": "a", "novel": True}, {"id": "b", "novel": True}]}
    response = post(client, action="recommend", evidence_bundle_json=bundle,
                    observation_json={"retrieved_items": 1})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_observation"
    assert "novel_items" in error["message"] and "retrieved_items" in error["message"]


# ---- checkpoint_now ------------------------------------------------------------------------------

def test_checkpoint_now_arms_the_verified_sessions_tenant(client: TestClient, world: Any) -> None:
    token = world.session()
    body = post(client, action="checkpoint_now", session_id="s-1", session_token=token,
                persist=True, trigger="agent").json()
    assert body["armed"] is True and body["tenant"] == "acme" and body["persist"] is True
    assert body["detail"].startswith("armed")
    # The caller's credential goes to the target to bind the arm (the scheduler's control port
    # keeps only its digest: tests/connector/test_scheduler_parts.py).
    assert world.side.armed[("acme", "s-1")] == {
        "trigger": "agent", "persist": True, "session_token": token}


@pytest.mark.parametrize(("declared", "tenant"), [("beta", "beta"), (None, "default")])
def test_checkpoint_now_without_credential_uses_the_declared_tenant(
        client: TestClient, world: Any, declared: str | None, tenant: str) -> None:
    body = post(client, action="checkpoint_now", session_id="s-2",
                **({"tenant": declared} if declared else {})).json()
    assert body["tenant"] == tenant
    assert world.side.armed[(tenant, "s-2")]["persist"] is False


def test_checkpoint_now_refuses_a_credential_that_does_not_verify(
    client: TestClient, world: Any
) -> None:
    expired = world.expired_session()
    response = post(client, action="checkpoint_now", session_id="s-3", session_token=expired)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "credential_refused"
    assert "expired" in response.json()["error"]["message"]
    assert expired not in response.text

    mismatch = post(
        client,
        action="checkpoint_now",
        session_id="s-3",
        session_token=world.session(),
        tenant="beta",
    )
    assert mismatch.status_code == 403 and "disagrees" in mismatch.json()["error"]["message"]
    assert world.side.armed == {}


def test_checkpoint_now_needs_a_session_id(client: TestClient) -> None:
    response = post(client, action="checkpoint_now")
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert ["body", "checkpoint_now", "session_id"] in [f["loc"] for f in error["fields"]]


# ---- promote and explain -------------------------------------------------------------------------

def explain(client: TestClient, checkpoint_id: str, **who: Any) -> Any:
    return post(client, action="explain", checkpoint_id=checkpoint_id, **who)


def test_promote_without_credential_is_refused_and_explain_says_why(
    client: TestClient, world: Any
) -> None:
    cid = world.checkpoint()
    body = post(client, action="promote", checkpoint_id=cid, tenant="acme").json()
    assert body["status"] == "refused"
    assert body["decision"]["failed_check"] == "verified_authority"

    explanation = explain(client, cid).json()["explanation"]
    assert explanation["tier"] == "ram"
    assert explanation["refusal"].startswith("refused at verified_authority: no checked session")
    assert explanation["eligibility_decision"]["permitted"] is False
    assert world.disk.stats().checkpoints == 0


def test_promote_with_an_expired_credential_is_refused_and_explained(
    client: TestClient, world: Any
) -> None:
    cid = world.checkpoint()
    body = post(client, action="promote", checkpoint_id=cid, session_token=world.expired_session(),
                tenant="acme").json()
    assert body["status"] == "refused"
    refusal = explain(client, cid, tenant="acme").json()["explanation"]["refusal"]
    assert refusal.startswith("refused at verified_authority") and "expired" in refusal


def test_promote_with_the_callers_session_persists(client: TestClient, world: Any) -> None:
    cid = world.checkpoint(pages=4)
    post(client, action="promote", checkpoint_id=cid, tenant="acme")  # refused first
    body = post(client, action="promote", checkpoint_id=cid, session_token=world.session()).json()
    assert body["status"] == "persisted" and body["decision"]["permitted"] is True

    explanation = explain(client, cid, session_token=world.session()).json()["explanation"]
    assert explanation["tier"] == "ram+disk" and explanation["persisting"] is None
    assert explanation["source_ids"] == ["doc-public"]
    assert explanation["refusal"] is None  # the earlier refusal is superseded
    assert [c["verdict"] for c in explanation["eligibility_decision"]["derivation"]["checks"]] == [
        "pass"
    ] * 9
    assert tuple(world.disk.load(cid, "acme").shape) == (4, 256)


def test_promote_refusal_names_the_unlabelled_source(client: TestClient, world: Any) -> None:
    cid = world.checkpoint(source_ids=["doc-unlabelled"])
    body = post(client, action="promote", checkpoint_id=cid, session_token=world.session()).json()
    assert body["status"] == "refused" and body["decision"]["failed_check"] == "labels_present"
    assert "doc-unlabelled" in explain(client, cid).json()["explanation"]["refusal"]


def test_another_tenant_sees_no_checkpoint(client: TestClient, world: Any) -> None:
    cid = world.checkpoint()
    other = world.session(tenant="globex")
    for response in (post(client, action="promote", checkpoint_id=cid, session_token=other),
                     explain(client, cid, session_token=other),
                     explain(client, cid, tenant="globex")):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "checkpoint_not_found"
    assert explain(client, cid).json()["explanation"]["refusal"] is None  # nothing was recorded


def test_explain_an_unknown_checkpoint(client: TestClient) -> None:
    response = explain(client, "0" * 32)
    assert (
        response.status_code == 404 and response.json()["error"]["code"] == "checkpoint_not_found"
    )


def test_ram_stats_reports_occupancy_gate_and_scorers(client: TestClient, world: Any) -> None:
    world.checkpoint(pages=2)
    world.checkpoint(pages=3)
    stats = post(client, action="ram_stats").json()["stats"]
    assert (stats["entries"], stats["pages"], stats["bytes_used"]) == (2, 5, 5 * 256)
    assert stats["tenant_bytes"] == {"acme": 5 * 256}
    assert stats["gate_in_force"] == "derived_authority" and stats["persists_in_flight"] == 0
    assert stats["scorers"]["rebuild_cost"] == pytest.approx(0.30)
    assert set(stats["scorers"]) == {
        "rebuild_cost", "predicted_reuse", "retrieval_saturation", "grounding_density",
        "contradictions", "context_stability", "phase_boundary", "model_self_report"}
    assert stats["disk"]["checkpoints"] == 0
    assert stats["admission"]["mode"] == "fixed"


# ---- request errors ------------------------------------------------------------------------------

def test_fields_must_fit_the_action(client: TestClient) -> None:
    response = post(client, action="ram_stats", checkpoint_id="abc")
    assert response.status_code == 422
    assert response.json()["error"]["fields"][0]["loc"] == ["body", "ram_stats", "checkpoint_id"]
    assert post(client, action="checkpoint").status_code == 422


def test_errors_never_echo_a_credential(client: TestClient) -> None:
    secret = "eyJ-not-a-real-credential-but-secret"
    response = post(client, action="checkpoint_now", session_id="bad id!", session_token=secret,
                    delegation_tokens=[secret])
    assert response.status_code == 422
    assert secret not in response.text


def test_unreadable_body_unknown_path_and_method(client: TestClient) -> None:
    bad = client.post(ENDPOINT, content=b"\xff\xfe{", headers={"content-type": "application/json"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_body")
    missing = client.post("/api/graph/other", json={})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    wrong = client.get(ENDPOINT)
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")


def test_body_over_the_limit_is_refused_413(client: TestClient) -> None:
    big = (
        b'{"action": "recommend", "observation_json": {"phase": "'
        + b"x" * DEFAULT_MAX_BODY_BYTES
        + b'"}}'
    )
    declared = client.post(ENDPOINT, content=big, headers={"content-type": "application/json"})
    assert (declared.status_code, declared.json()["error"]["code"]) == (413, "body_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap counts the bytes as they come
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]

    streamed = client.post(ENDPOINT, content=chunks(), headers={"content-type": "application/json"})
    assert (streamed.status_code, streamed.json()["error"]["code"]) == (413, "body_too_large")

    under = b'{"action": "recommend", "observation_json": {"phase": "' + b"x" * 1000 + b'"}}'
    assert (
        client.post(
            ENDPOINT, content=under, headers={"content-type": "application/json"}
        ).status_code
        == 422
    )


def test_bearer_token_guards_every_path(world: Any) -> None:
    client = TestClient(control_app(world.plane))
    for headers in ({}, {"Authorization": "Bearer wrong-token-of-some-length"},
                    {"Authorization": "Basic " + OPERATOR_TOKEN}, {"Authorization": OPERATOR_TOKEN},
                    {"Authorization": "Bearer " + OPERATOR_TOKEN[:-1]}):
        response = client.post(ENDPOINT, json={"action": "ram_stats"}, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert client.get("/openapi.json").status_code == 401

    for token in (OPERATOR_TOKEN, TENANT_TOKEN):
        good = {"Authorization": "Bearer " + token}
        assert client.post(ENDPOINT, json={"action": "ram_stats"}, headers=good).status_code == 200
        assert client.get("/openapi.json", headers=good).status_code == 200


# ---- advisory ------------------------------------------------------------------------------------

def test_advisory_returns_what_the_sessions_latest_request_was_told(
    client: TestClient, world: Any
) -> None:
    first, latest = (
        {"tier": "none", "hit_tokens": 0},
        {"tier": "ram", "checkpoint_id": "c1", "hit_tokens": 64},
    )
    world.side.verdicts.publish("acme", "run-1", first, verified=True)
    world.side.verdicts.publish("acme", "run-1", latest, verified=True)
    world.side.verdicts.publish("beta", "run-1", {"tier": "none"}, verified=False)

    body = post(client, action="advisory", session_id="run-1", session_token=world.session()).json()
    assert (body["tenant"], body["session_id"], body["kvci"]) == ("acme", "run-1", latest)
    assert body["finished_at"] <= time.time()
    declared = post(client, action="advisory", session_id="run-1", tenant="beta").json()
    assert declared["kvci"] == {"tier": "none"}
    # Declaring acme proves nothing: a verdict published under acme's credential needs one.
    unproven = post(client, action="advisory", session_id="run-1", tenant="acme")
    assert unproven.status_code == 404 and unproven.json()["error"]["code"] == "no_advisory"


@pytest.mark.parametrize("caller", [{"tenant": "gamma"}, {}, {"tenant": "acme"}])
def test_advisory_of_another_tenants_or_an_unknown_session_is_not_found(
        client: TestClient, world: Any, caller: dict[str, str]) -> None:
    world.side.verdicts.publish("acme", "run-2", {"tier": "ram"}, verified=False)
    session = "run-2" if caller.get("tenant") != "acme" else "run-3"
    response = post(client, action="advisory", session_id=session, **caller)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "no_advisory" and session in error["message"]


def test_advisory_refuses_a_credential_that_does_not_verify(client: TestClient, world: Any) -> None:
    world.side.verdicts.publish("acme", "run-4", {"tier": "ram"}, verified=False)
    response = post(
        client, action="advisory", session_id="run-4", session_token=world.expired_session()
    )
    assert response.status_code == 403 and response.json()["error"]["code"] == "credential_refused"


# ---- reset ---------------------------------------------------------------------------------------

def fenced_message(world: Any, checkpoint_id: str) -> str:
    with pytest.raises(CheckpointFencedError) as fenced:
        world.manager.explain(checkpoint_id)
    return str(fenced.value)


def test_reset_fences_every_checkpoint_and_explain_says_so(client: TestClient, world: Any) -> None:
    in_ram = world.checkpoint()
    on_disk = world.checkpoint(pages=2)
    assert post(client, action="promote", checkpoint_id=on_disk,
                session_token=world.session()).json()["status"] == "persisted"

    body = post(client, action="reset").json()  # no credential: an operator action
    assert (body["action"], body["status"], body["generation"]) == ("reset", "done", 1)
    assert (body["ram_checkpoints"], body["disk_checkpoints"]) == (2, 1)
    assert body["detail"].startswith("fenced 2 RAM and 1 disk checkpoints")
    assert "generation 1" in body["detail"]
    assert (
        "kvci's RAM and disk tiers only" in body["scope"] and "reset_prefix_cache" in body["scope"]
    )
    stats = post(client, action="ram_stats").json()["stats"]
    assert (stats["entries"], stats["disk"]["checkpoints"]) == (0, 0)

    for cid in (in_ram, on_disk):
        message = fenced_message(world, cid)
        assert "fenced by a cache reset" in message and "acme" not in message
        for who in ({}, {"tenant": "acme"}, {"session_token": world.session()}):
            response = explain(client, cid, **who)
            assert response.status_code == 410, who
            assert response.json()["error"] == {"code": "checkpoint_fenced", "message": message,
                                                "fields": []}


def test_another_tenants_fenced_checkpoint_is_not_found_like_an_unknown_one(
        client: TestClient, world: Any) -> None:
    cid = world.checkpoint()
    assert post(client, action="reset").json()["status"] == "done"
    unknown = "0" * 32
    expected = explain(client, unknown).json()["error"]
    expected["message"] = expected["message"].replace(unknown, cid)
    for who in ({"tenant": "globex"}, {"session_token": world.session(tenant="globex")}):
        response = explain(client, cid, **who)
        assert response.status_code == 404 and response.json()["error"] == expected, who
        assert "fenced" not in response.text


def test_reset_on_an_idle_engine_is_pending_until_its_next_hook(
    client: TestClient, world: Any
) -> None:
    world.side.idle = True
    cid = world.checkpoint()
    started = time.monotonic()
    body = post(client, action="reset", wait_s=0.2).json()
    assert time.monotonic() - started >= 0.2
    assert (
        body["status"],
        body["generation"],
        body["ram_checkpoints"],
        body["disk_checkpoints"],
    ) == ("pending", None, None, None)
    assert "before its next lookup" in body["detail"] and "reset_prefix_cache" in body["scope"]
    asked = world.side.reset_asked
    assert explain(client, cid).status_code == 200  # not applied yet

    assert post(client, action="reset", wait_s=0).json()["status"] == "pending"
    assert world.side.reset_asked is asked  # asked again: the same reset

    world.side.step()  # the scheduler's next hook (a request arrived)
    assert asked.result().generation == world.manager.generation == 1
    assert explain(client, cid).status_code == 410


def test_reset_waits_for_the_engine_to_apply_it(client: TestClient, world: Any) -> None:
    world.side.idle = True
    world.checkpoint()

    def next_step() -> None:
        while world.side.reset_asked is None:
            time.sleep(0.01)
        time.sleep(0.1)
        world.side.step()

    engine = threading.Thread(target=next_step, daemon=True)
    engine.start()
    started = time.monotonic()
    body = post(client, action="reset", wait_s=30).json()
    engine.join(5)
    assert time.monotonic() - started < 30
    assert (body["status"], body["generation"], body["ram_checkpoints"]) == ("done", 1, 1)


def test_a_failed_reset_is_an_internal_error_with_a_safe_message(
        client: TestClient, world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def locked() -> None:
        raise OSError("catalog /srv/kvci-private/catalog.sqlite is locked")

    world.checkpoint()
    monkeypatch.setattr(world.disk, "reset", locked)
    response = post(client, action="reset")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal_error"
    assert error["message"].startswith("the cache reset failed (OSError); see the engine's log.")
    assert "loads nothing from the disk tier" in error["message"]
    assert "kvci-private" not in response.text

    monkeypatch.undo()
    body = post(client, action="reset").json()  # asked again: a new reset, which succeeds
    assert (body["status"], body["generation"]) == ("done", 1)


@pytest.mark.parametrize("extra", [{"tenant": "acme"}, {"session_token": "t" * 40}, {"wait_s": 61},
                                   {"wait_s": -1}, {"wait_s": "5"}, {"wait_s": True}])
def test_reset_takes_no_credential_and_a_bounded_wait(client: TestClient, world: Any,
                                                      extra: dict[str, Any]) -> None:
    response = post(client, action="reset", **extra)
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"
    assert world.side.reset_asked is None
