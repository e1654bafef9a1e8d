"""`forget` on the control surface: crypto-erasure of one tenant, gated like promote on a
verified credential with the kv:forget scope; afterwards explain says the checkpoint was
forgotten, the disk tier loads none of it, other tenants keep theirs, and no key material shows."""

from __future__ import annotations

from typing import Any

import pytest
from control_support import control_client
from starlette.testclient import TestClient

from kvci_plugin.api.schema import ENDPOINT
from kvci_plugin.governance import FORGET_SCOPE
from kvci_plugin.tiering.blobs.tenant_keys import TOMBSTONE
from kvci_plugin.tiering.types import CheckpointNotFoundError


@pytest.fixture
def client(world: Any) -> TestClient:
    return control_client(world.plane)  # the operator's token: explain naming no tenant sees any


def post(client: TestClient, **body: Any) -> Any:
    return client.post(ENDPOINT, json=body)


def persisted(client: TestClient, world: Any, tenant: str = "acme") -> str:
    cid = world.checkpoint(tenant=tenant, pages=2)
    body = post(client, action="promote", checkpoint_id=cid,
                session_token=world.session(tenant=tenant)).json()
    assert body["status"] == "persisted", body
    return cid


@pytest.mark.parametrize(("credential", "check"), [
    (None, "verified_authority: forget needs a session credential"),
    ("persist-only", "forget_scope: the effective authority lacks the 'kv:forget' scope"),
    ("other-tenant", "tenancy: the credential is for another tenant"),
    ("expired", "verified_authority: session: expired"),
    ("ceiling", "forget_scope"),
])
def test_forget_is_refused_without_a_verified_credential_holding_the_scope(
        client: TestClient, world: Any, credential: str | None, check: str) -> None:
    cid = persisted(client, world)
    body: dict[str, Any] = {"action": "forget", "tenant": "acme"}
    if credential == "persist-only":
        body["session_token"] = world.session()
    elif credential == "other-tenant":
        body["session_token"] = world.session(tenant="globex", scopes=[FORGET_SCOPE])
    elif credential == "expired":
        body["session_token"] = world.session(scopes=[FORGET_SCOPE], now=0, ttl_s=60)
    elif credential == "ceiling":  # the session has the scope; its delegation ceiling does not
        body["session_token"] = world.session(scopes=[FORGET_SCOPE, "kv:persist"], actor="bot")
        body["delegation_tokens"] = [world.issuer.issue_delegation(
            tenant="acme", delegator="alice", delegate="bot", scopes=["kv:persist"],
            clearance="INTERNAL", markings=[], regions=["eu"])]
    response = post(client, **body)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "credential_refused" and check in error["message"]
    assert post(client, action="explain", checkpoint_id=cid, tenant="acme").status_code == 200


def test_forget_erases_the_tenant_and_explain_says_so(client: TestClient, world: Any) -> None:
    on_disk = persisted(client, world)
    in_ram = world.checkpoint()
    theirs = persisted(client, world, tenant="globex")
    root_keys = world.disk._blob_root.keys
    material = root_keys._materials.read_material(root_keys.tenant_id("acme"))
    assert material is not None

    response = post(client, action="forget", tenant="acme",
                    session_token=world.session(scopes=[FORGET_SCOPE]))
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["ram_checkpoints"], body["disk_checkpoints"], body["key_destroyed"]) == (
        2,
        1,
        True,
    )
    assert "destroyed" in body["detail"]
    assert material.hex() not in response.text and root_keys._root.hex() not in response.text
    # A tombstone stands where the material was: no writer makes it again (tenant_keys).
    assert root_keys._materials.read_material(root_keys.tenant_id("acme")) == TOMBSTONE

    for cid in (on_disk, in_ram):
        for who in ({}, {"tenant": "acme"}, {"session_token": world.session()}):
            answer = post(client, action="explain", checkpoint_id=cid, **who)
            assert answer.status_code == 410, (cid, who)
            error = answer.json()["error"]
            assert error["code"] == "checkpoint_forgotten" and "forgotten" in error["message"]
            assert "acme" not in error["message"]
        # Another tenant asking learns nothing: not found, like an unknown id.
        assert post(client, action="explain", checkpoint_id=cid,
                    tenant="globex").json()["error"]["code"] == "checkpoint_not_found"
    with pytest.raises(CheckpointNotFoundError):
        world.disk.load(on_disk, "acme")
    # The other tenant still has its checkpoint, in RAM and on disk.
    assert post(client, action="explain", checkpoint_id=theirs, tenant="globex").json()[
        "explanation"]["tier"] == "ram+disk"
    assert world.disk.load(theirs, "globex").shape[0] == 2


def test_forget_of_a_tenant_with_nothing_stored_says_no_material_existed(
        client: TestClient, world: Any) -> None:
    body = post(client, action="forget", tenant="initech",
                session_token=world.session(tenant="initech", scopes=[FORGET_SCOPE])).json()
    assert (body["ram_checkpoints"], body["disk_checkpoints"], body["key_destroyed"]) == (
        0,
        0,
        False,
    )
