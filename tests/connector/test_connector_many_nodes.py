"""Two vLLM engines on one shared disk tier: a PostgreSQL catalog and a Redis blob store.

Node A (its own process) persists a checkpoint with a valid credential and has another refused;
node B, a separate engine started while A still runs, serves the persisted one from the shared
tier with greedy output equal to recomputing, never sees the refused one, and refuses the
checkpoint to another tenant although the catalog row is visible to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from durable_support import prompts, setup_dirs, shared_catalog_ids, start_node
from engine import BLOCK_SIZE, baseline_outputs, generate_one, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

NODE = Path(__file__).with_name("shared_node.py")


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, prompts())


@pytest.fixture(scope="module")
def shared_extra(tmp_path_factory, postgres_url, redis_url):
    from services import new_database

    root = tmp_path_factory.mktemp("many-nodes")
    extra = setup_dirs(root)
    del extra["disk_root"]  # the blobs live in Redis, the catalog in PostgreSQL
    extra.update(catalog_url=new_database(postgres_url), blob_url=f"{redis_url}/15")
    import redis

    redis.Redis.from_url(extra["blob_url"]).flushdb()
    return root, extra


@pytest.fixture(scope="module")
def node_a(tiny_model, baseline, shared_extra):
    root, extra = shared_extra
    proc, ready = start_node(NODE, root, tiny_model, extra)
    yield ready
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=120)


@pytest.fixture(scope="module")
def node_b(tiny_model, node_a, shared_extra):
    _, extra = shared_extra
    llm = make_llm(tiny_model, extra)
    yield llm
    shutdown(llm)


def test_persisted_on_node_a_is_served_from_the_shared_tier_on_node_b(node_a, node_b, baseline):
    assert node_a["persisted"]["persist"]["status"] in ("persisting", "persisted")
    out = generate_one(node_b, prompts()["persisted"], kvci_params(tenant="acme"))
    assert out.kv_transfer_params["kvci"]["hit_tier"] == "disk"
    assert out.num_cached_tokens == 5 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["persisted"]


def test_a_refused_checkpoint_is_visible_to_neither_node(node_a, node_b, shared_extra, baseline):
    _, extra = shared_extra
    refused = node_a["refused"]
    assert refused["persist"]["status"] == "refused"
    assert refused["persist"]["decision"]["failed_check"] == "verified_authority"
    ids = shared_catalog_ids(extra["catalog_url"])
    assert refused["checkpoint_id"] not in ids
    assert node_a["persisted"]["checkpoint_id"] in ids
    out = generate_one(node_b, prompts()["refused"], kvci_params(tenant="acme"))
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == baseline["refused"]


def test_node_b_refuses_another_tenant_although_it_sees_the_row(node_a, node_b, baseline):
    out = generate_one(node_b, prompts()["persisted"], kvci_params(tenant="globex"))
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == baseline["persisted"]
