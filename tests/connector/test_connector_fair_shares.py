"""Fair shares on a real engine: three verified tenants share a small RAM tier. One (mallory)
floods it with explicit checkpoints and retentions between two rounds of the others' prompts;
acme and globex keep their shares, and their second round hits as it does when nobody floods.
(Before fair shares, mallory's explicit checkpoints, evicted last, pushed out the others'.)"""

from __future__ import annotations

import random

import pytest
from durable_support import session_token, setup_dirs
from engine import generate_one, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

BLOCK = 32
PAGES = 24  # the RAM tier: three tenants' fair shares of 8 pages
KEEPERS = ("acme", "globex")


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(3 * BLOCK + 7)]  # three pages


@pytest.fixture(scope="module")
def fair(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fair")
    extra = setup_dirs(root)
    for name in ("disk_root", "disk_bytes", "disk_region"):
        del extra[name]
    extra.update(ram_bytes=f"{PAGES * 16}KiB", ram_policy="lru")
    llm = make_llm(tiny_model, extra, max_num_batched_tokens=128)
    try:
        yield llm, {t: session_token(root, tenant=t) for t in (*KEEPERS, "mallory")}
    finally:
        shutdown(llm)


def _send(llm, tokens, token, **kvci):
    out = generate_one(llm, tokens, kvci_params(session_token=token, **kvci))
    return out.kv_transfer_params["kvci"]


def _hit_rate(llm, tokens, flood: list[list[int]]) -> dict[str, float]:
    """Each keeper keeps two prompts, mallory floods (or not), each keeper sends them again:
    the share of the second round's prompt tokens that kvci served, per keeper."""
    prompts = {t: [_prompt(rng) for _ in range(2)] for t, rng in
               ((t, random.Random(f"{t}{len(flood)}")) for t in KEEPERS)}
    for tenant, mine in prompts.items():
        for p in mine:
            assert _send(llm, p, tokens[tenant], checkpoint="now")["tier"] == "ram"
    for p in flood:
        _send(llm, p, tokens["mallory"], checkpoint="now", retain={"ttl_s": 300.0})
    rates = {}
    for tenant, mine in prompts.items():
        hit = sum(_send(llm, p, tokens[tenant])["hit_tokens"] for p in mine)
        rates[tenant] = hit / (len(mine) * 3 * BLOCK)
    return rates


def test_a_tenant_flooding_explicit_checkpoints_and_retentions_leaves_the_others_their_shares(
        fair):
    llm, tokens = fair
    quiet = _hit_rate(llm, tokens, flood=[])
    assert all(rate == 1.0 for rate in quiet.values()), quiet
    rng = random.Random(7)
    flooded = _hit_rate(llm, tokens, flood=[_prompt(rng) for _ in range(12)])
    for tenant in KEEPERS:
        assert flooded[tenant] >= 0.9 * quiet[tenant], (tenant, quiet, flooded)
    # Mallory's retentions were bounded by its share too: a flood of them was refused past it.
    refused = _send(llm, _prompt(rng), tokens["mallory"], checkpoint="now",
                    retain={"ttl_s": 300.0})["retain"]
    assert refused is not None and refused["status"] == "refused", refused
