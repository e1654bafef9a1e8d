"""`tenancy: "verified"` on a real engine: only a verified session credential sets the tenant.

A request that only declares a tenant (or sends no kvci params at all) is served with no kvci
tier — no lookup, no store — and its reply says why, so it gets no hit on the verified tenant's
checkpoint; a request with that tenant's credential hits it; another tenant's credential misses.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from durable_support import catalog_rows, session_token, setup_dirs
from engine import BLOCK_SIZE, generate_one, greedy, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

PROMPT = [random.Random(21).randrange(2, 1000) for _ in range(4 * BLOCK_SIZE + 5)]
SOURCES = ["doc:handbook"]


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("verified")
    extra = {**setup_dirs(root), "tenancy": "verified"}
    llm = make_llm(tiny_model, extra, disable_log_stats=False)
    yield root, extra, llm
    shutdown(llm)


@pytest.fixture(scope="module")
def persisted(node) -> dict[str, Any]:
    """acme's checkpoint of PROMPT, kept in RAM and recorded on disk by a verified request."""
    root, extra, llm = node
    token = session_token(root)
    out = generate_one(llm, PROMPT, kvci_params(session_token=token, persist=True,
                                                  source_ids=SOURCES))
    reply = out.kv_transfer_params["kvci"]
    assert "error" not in reply and reply["checkpoint_id"], reply
    deadline = time.monotonic() + 60
    while reply["checkpoint_id"] not in catalog_rows(Path(extra["disk_root"])):
        assert time.monotonic() < deadline, "the persist never reached the catalog"
        generate_one(llm, [5, 6, 7], kvci_params(session_token=token))
    return {"reply": reply, "tokens": list(out.outputs[0].token_ids), "token": token}


def test_a_declared_only_tenant_gets_no_hit_and_the_reply_says_why(node, persisted) -> None:
    _, _, llm = node
    for params in (kvci_params(tenant="acme"), kvci_params(tenant="acme", source_ids=SOURCES,
                                                             checkpoint="now"), greedy()):
        out = generate_one(llm, PROMPT, params)
        assert out.num_cached_tokens == 0
        reply = out.kv_transfer_params["kvci"]
        assert set(reply) == {"error"}
        assert (
            'tenancy is "verified"' in reply["error"] and "without any kvci tier" in reply["error"]
        )
        assert "acme" not in reply["error"]
        assert list(out.outputs[0].token_ids) == persisted["tokens"]


def test_a_verified_request_hits_the_tenants_checkpoint(node, persisted) -> None:
    _, _, llm = node
    out = generate_one(llm, PROMPT, kvci_params(session_token=persisted["token"]))
    assert out.num_cached_tokens == 4 * BLOCK_SIZE
    reply = out.kv_transfer_params["kvci"]
    assert reply["hit_tokens"] == 4 * BLOCK_SIZE and "error" not in reply
    assert list(out.outputs[0].token_ids) == persisted["tokens"]


def test_another_verified_tenant_misses_and_a_disagreeing_declaration_is_refused(
        node, persisted) -> None:
    root, _, llm = node
    globex = session_token(root, tenant="globex")
    out = generate_one(llm, PROMPT, kvci_params(session_token=globex))
    assert out.num_cached_tokens == 0 and "error" not in out.kv_transfer_params["kvci"]
    out = generate_one(llm, PROMPT, kvci_params(session_token=globex, tenant="acme"))
    assert out.num_cached_tokens == 0
    assert "disagrees" in out.kv_transfer_params["kvci"]["error"]


def test_no_key_material_reaches_a_reply_or_the_metrics(node, persisted) -> None:
    root, extra, llm = node
    secrets = [(root / "state" / "secret").read_bytes()]
    secrets += [p.read_bytes() for p in (Path(extra["disk_root"]) / "keys").glob("*.key")]
    assert len(secrets) == 2  # the root key and acme's material
    out = generate_one(llm, PROMPT, kvci_params(session_token=persisted["token"]))
    metrics = llm.get_metrics()
    assert any(m.name.startswith("vllm:kvci_") for m in metrics)
    said = json.dumps([persisted["reply"], out.kv_transfer_params]) + repr(metrics)
    for secret in secrets:
        assert secret.hex() not in said and secret.hex()[:16] not in said


def test_verified_tenancy_needs_credentials_and_a_key_file_names_the_root_key(tmp_path) -> None:
    from kvci_plugin.connector.config import KVCIConfig
    from kvci_plugin.tiering.blobs.tenant_keys import KeyFileRootKey, StateDirRootKey

    with pytest.raises(ValueError, match="tenancy 'verified' needs credentials"):
        KVCIConfig.from_extra_config({"tenancy": "verified"})
    with pytest.raises(ValueError, match="tenancy"):
        KVCIConfig.from_extra_config({"tenancy": "gateway"})
    assert KVCIConfig.from_extra_config({"state_dir": str(tmp_path)}).root_key == StateDirRootKey(
        tmp_path
    )
    key = tmp_path / "root.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o644)
    provider = KVCIConfig.from_extra_config({"key_file": str(key)}).root_key
    assert provider == KeyFileRootKey(key)
    with pytest.raises(PermissionError, match="readable by its owner only"):
        provider.root_key()  # a root key others can read is refused, never used
    key.chmod(0o600)
    assert provider.root_key() == b"k" * 32
