"""The per-request `lmcache.*` entries through which kvci's decision reaches LMCache.

LMCache 0.5.x copies every `lmcache.*` entry of `sampling_params.extra_args["kv_transfer_params"]`
into the request's "request configs" (`extract_request_configs_from_sampling_params`), at two
moments: the lookup in `get_num_new_matched_tokens`, and the request's first
`build_connector_meta`, where `RequestTracker.from_new_request` snapshots them for the request's
whole life. From there they travel to the worker in `ReqMeta.request_configs` and into every
`CacheEngineKey` LMCache stores. Three entries matter:

- `lmcache.skip_save` (read by `ReqMeta.from_request_tracker`): truthy = save nothing.
- `lmcache.tag.kvci_tenant`: LMCache tags are part of key equality, so a tenant's chunks are
  found only by that tenant's requests (a digest, since `@` and `%` would break LMCache's key
  strings, and tenant names stay out of file names). The default tenant carries no tag, so a
  request without kvci params keys exactly as under plain LMCache.
- `lmcache.kvci.durable_until`: the permit of the eligibility gate, as the retention expiry in
  unix seconds ("inf" = no limit). Only kvci's gated durable backends read it.

A client must not forge the last two: every client-sent `lmcache.kvci.*` entry and tenant tag is
dropped before kvci writes its own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

SKIP_SAVE = "lmcache.skip_save"
TENANT_TAG = "lmcache.tag.kvci_tenant"
DURABLE_UNTIL = "lmcache.kvci.durable_until"
_KVCI_PREFIX = "lmcache.kvci."
_NO_LIMIT = "inf"


def tenant_tag(tenant: str, default_tenant: str) -> str | None:
    if tenant == default_tenant:
        return None
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


def client_skips_save(kv_transfer_params: Any) -> bool:
    """Whether the client itself asked LMCache to skip the save (LMCache's truthiness test)."""
    return isinstance(kv_transfer_params, Mapping) and bool(
        kv_transfer_params.get(SKIP_SAVE, False)
    )


def durable_marker(retention_expiry: float | None) -> str:
    """The `durable_until` value for a permit; None = the gate set no retention limit."""
    return _NO_LIMIT if retention_expiry is None else repr(float(retention_expiry))


def durable_until(request_configs: Mapping[str, Any] | None) -> float | None:
    """The permit's expiry (math.inf = no limit), or None when the request carries no valid
    permit."""
    if not request_configs:
        return None
    value = request_configs.get(DURABLE_UNTIL)
    if not isinstance(value, str):
        return None
    try:
        until = float(value)
    except ValueError:
        return None
    return None if math.isnan(until) else until


def write_decision(sampling_params: Any, *, skip_save: bool, tag: str | None,
                   durable: str | None) -> dict[str, Any]:
    """Give the request a fresh `kv_transfer_params` carrying kvci's entries; returns it.

    A fresh dict, never an in-place edit: with `SamplingParams.skip_clone` vLLM shares one
    `extra_args` dict between the requests of a batch, and one request's decision must not
    leak into another's.
    """
    extra_args = sampling_params.extra_args or {}
    old = extra_args.get("kv_transfer_params")
    params = {key: value for key, value in (old.items() if isinstance(old, Mapping) else ())
              if not (isinstance(key, str) and (key.startswith(_KVCI_PREFIX) or key == TENANT_TAG))}
    params[SKIP_SAVE] = skip_save
    if tag is not None:
        params[TENANT_TAG] = tag
    if durable is not None:
        params[DURABLE_UNTIL] = durable
    sampling_params.extra_args = {**extra_args, "kv_transfer_params": params}
    return params
