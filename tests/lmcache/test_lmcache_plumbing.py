"""kvci's decision as LMCache's own request classes read it.

`RequestTracker`, `ReqMeta`, `extract_request_configs` and `CacheEngineKey` are LMCache 0.5.x's
real classes (they build on CPU); the request is a real vLLM `Request`.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lmcache.integration.vllm.vllm_v1_adapter import (
    ReqMeta,
    RequestTracker,
    extract_request_configs,
)
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache_support import CHUNK
from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.request import Request

from kvci_plugin.lmcache.request_configs import (
    DURABLE_UNTIL,
    SKIP_SAVE,
    TENANT_TAG,
    durable_marker,
    durable_until,
    tenant_tag,
    write_decision,
)

PROMPT = list(range(100, 100 + 3 * CHUNK + 7))
BLOCKS = ([0, 1, 2, 3],)
LMCACHE_CONFIG = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)


def _request(kv_transfer_params: dict[str, Any] | None = None) -> Request:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return Request("req-1", list(PROMPT), SamplingParams(max_tokens=4, extra_args=extra), None)


def _first_step(request: Request) -> tuple[RequestTracker, ReqMeta | None]:
    """What LMCache's scheduler side does in the request's first build_connector_meta."""
    # prefill_token_ids: optional before vLLM 0.34, required from it (the scheduler passes them).
    new = NewRequestData.from_request(request, BLOCKS, list(request.all_token_ids))
    tracker = RequestTracker.from_new_request(LMCACHE_CONFIG, new, len(PROMPT), 0, False)
    return tracker, ReqMeta.from_request_tracker(tracker, CHUNK, CHUNK)


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("durable", [None, "inf"])
def test_lmcache_saves_exactly_what_kvci_decided(save: bool, durable: str | None):
    request = _request({"kvci": {"session_id": "s"}})
    tag = tenant_tag("acme", "default")
    write_decision(
        request.sampling_params, skip_save=not save, tag=tag, durable=durable if save else None
    )
    tracker, meta = _first_step(request)
    if not save:
        assert meta is None  # LMCache neither saves nor loads anything for the request
        return
    assert meta is not None and meta.save_spec is not None and meta.save_spec.can_save
    assert meta.token_ids == PROMPT[: 3 * CHUNK]
    expected = {SKIP_SAVE: False, TENANT_TAG: tag, **({DURABLE_UNTIL: durable} if durable else {})}
    assert meta.request_configs == expected


def test_the_decision_must_precede_the_first_step_because_lmcache_snapshots_it():
    request = _request()
    tracker, meta = _first_step(request)
    write_decision(request.sampling_params, skip_save=True, tag=None, durable=None)
    assert meta is not None and meta.save_spec is not None and meta.save_spec.can_save
    assert tracker.request_configs is None  # later steps read this snapshot, not the request


def test_a_skipped_request_stays_skipped_in_later_steps():
    request = _request()
    write_decision(request.sampling_params, skip_save=True, tag=None, durable=None)
    tracker, _ = _first_step(request)
    tracker.update([7] * CHUNK, [4])
    assert ReqMeta.from_request_tracker(tracker, CHUNK, CHUNK) is None


_KEYS = st.sampled_from(
    [
        SKIP_SAVE,
        TENANT_TAG,
        DURABLE_UNTIL,
        "lmcache.kvci.anything",
        "lmcache.tag.team",
        "lmcache.other",
        "kvci",
        "do_remote_prefill",
    ]
)
_VALUES = st.one_of(st.booleans(), st.text(max_size=8), st.integers(-3, 3), st.none())


@settings(max_examples=150, deadline=None)
@given(client=st.none() | st.dictionaries(_KEYS, _VALUES, max_size=8), skip=st.booleans(),
       tenant=st.sampled_from(["default", "acme"]), durable=st.sampled_from([None, "inf", "1e12"]))
def test_only_kvci_writes_its_entries_and_the_clients_others_survive(client, skip, tenant, durable):
    request = _request(client)
    tag = tenant_tag(tenant, "default")
    written = write_decision(request.sampling_params, skip_save=skip, tag=tag, durable=durable)
    configs = extract_request_configs(request.sampling_params)
    assert configs is not None
    assert configs[SKIP_SAVE] is skip
    assert configs.get(TENANT_TAG) == tag  # a forged tag never survives
    assert configs.get(DURABLE_UNTIL) == durable  # nor a forged permit
    assert not any(key.startswith("lmcache.kvci.") and key != DURABLE_UNTIL for key in configs)
    for key, value in (client or {}).items():
        if key in ("lmcache.tag.team", "lmcache.other", "kvci", "do_remote_prefill"):
            assert written[key] == value


def test_requests_that_share_extra_args_do_not_share_decisions():
    shared = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"kvci": {}}})
    first, second = copy.copy(shared), copy.copy(shared)  # what vLLM's skip_clone does
    write_decision(first, skip_save=True, tag=None, durable=None)
    write_decision(second, skip_save=False, tag=tenant_tag("acme", "default"), durable="inf")
    assert extract_request_configs(first) == {SKIP_SAVE: True}
    assert extract_request_configs(shared) is None


def _key(request_configs: dict[str, Any] | None) -> CacheEngineKey:
    return CacheEngineKey("model", 1, 0, 0x1234, torch.bfloat16, request_configs)


def test_the_tenant_tag_separates_keys_and_the_permit_does_not():
    acme, globex = tenant_tag("acme", "default"), tenant_tag("globex", "default")
    permitted = _key({TENANT_TAG: acme, SKIP_SAVE: False, DURABLE_UNTIL: "inf"})
    assert permitted == _key({TENANT_TAG: acme, SKIP_SAVE: False})
    assert permitted != _key({TENANT_TAG: globex, SKIP_SAVE: False})
    assert permitted != _key({SKIP_SAVE: False})


@settings(max_examples=100, deadline=None)
@given(tenant=st.from_regex(r"[A-Za-z0-9._:@-]{1,40}", fullmatch=True))
def test_any_tenant_name_keeps_lmcache_key_strings_parseable(tenant: str):
    tag = tenant_tag(tenant, "default")
    key = _key({TENANT_TAG: tag} if tag is not None else None)
    assert CacheEngineKey.from_string(key.to_string()) == key


def test_the_permit_survives_lmcache_key_serialization():
    key = _key({DURABLE_UNTIL: durable_marker(1.5e12), SKIP_SAVE: False})
    assert durable_until(CacheEngineKey.from_dict(key.to_dict()).request_configs) == 1.5e12


@settings(max_examples=100, deadline=None)
@given(expiry=st.none() | st.floats(allow_nan=False, allow_infinity=False))
def test_a_permit_marker_reads_back_as_its_expiry(expiry: float | None):
    until = durable_until({DURABLE_UNTIL: durable_marker(expiry)})
    assert until == (math.inf if expiry is None else expiry)


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(st.text(max_size=12), st.floats(), st.integers(), st.none()))
def test_anything_but_a_number_string_is_no_permit(value: Any):
    until = durable_until({DURABLE_UNTIL: value})
    if until is not None:
        assert isinstance(value, str) and float(value) == until and not math.isnan(until)
