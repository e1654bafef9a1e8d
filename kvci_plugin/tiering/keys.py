"""Namespace fingerprints: which model, revision, KV format and rank a block key belongs to.

The namespace is hashed into every prefix key (``kvci_plugin.ops.prefix_block_keys``), so KV
computed under one namespace can never be found under another: a new model revision, KV dtype,
block size, layout or parallel rank is a miss, never stale KV.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping

from kvci_plugin.ops import KEY_FORMAT

NAMESPACE_FORMAT = "kvci-namespace-v1"
"""Names the canonical encoding below; it is itself part of the hashed document."""

NAMESPACE_BYTES = 32

_Canonical = None | bool | int | float | str | list["_Canonical"] | dict[str, "_Canonical"]


def namespace_fingerprint(
    *,
    model_id: str,
    model_config: Mapping[str, object],
    weights_fingerprint: str,
    kv_cache_dtype: str,
    block_size: int,
    kv_layout: str,
    tp_rank: int,
    tp_size: int,
) -> bytes:
    """SHA-256 (32 bytes) of the canonical encoding of every component and of the formats.

    The encoding is JSON with sorted keys and no whitespace, over a document that also names
    ``NAMESPACE_FORMAT`` and the key format. ``model_config`` may hold None, bool, int, finite
    float, str, lists/tuples and mappings with str keys; its key order does not matter. Anything
    else (NaN, bytes, functions, other objects) is refused rather than hashed ambiguously.
    """
    if not isinstance(model_config, Mapping):
        raise TypeError(f"model_config must be a mapping, not {type(model_config).__name__}")
    document = {
        "format": NAMESPACE_FORMAT,
        "key_format": KEY_FORMAT,
        "model_id": _text("model_id", model_id),
        "model_config": _canonical("model_config", model_config, set()),
        "weights_fingerprint": _text("weights_fingerprint", weights_fingerprint),
        "kv_cache_dtype": _text("kv_cache_dtype", kv_cache_dtype),
        "block_size": _count("block_size", block_size, minimum=1),
        "kv_layout": _text("kv_layout", kv_layout),
        "tp_rank": _count("tp_rank", tp_rank, minimum=0),
        "tp_size": _count("tp_size", tp_size, minimum=1),
    }
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank must be below tp_size ({tp_size}), got {tp_rank}")
    encoded = json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return hashlib.sha256(encoded.encode("ascii")).digest()


def generation_namespace(namespace: bytes, generation: int) -> bytes:
    """The namespace KV is keyed under in ``generation`` of an engine's ``namespace``.

    A cache reset (the step after an in-place weight update) starts a new generation: every key
    changes, so nothing computed before it can be found after it, whichever tier holds it.
    Generation 0 is the namespace itself, so KV kept before generations existed still loads.
    """
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, not {len(namespace)}")
    gen = _count("generation", generation, minimum=0)
    if gen == 0:
        return namespace
    return hashlib.sha256(b"kvci-generation\0" + namespace + gen.to_bytes(8, "big")).digest()


def _text(name: str, value: object) -> str:
    if type(value) is not str:
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value


def _count(name: str, value: object, *, minimum: int) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _canonical(path: str, value: object, open_containers: set[int]) -> _Canonical:
    """``value`` as plain JSON types, or a clear error naming where it cannot be encoded."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value  # type: ignore[return-value]
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise ValueError(f"{path} is {value}: non-finite floats cannot be encoded")
        return value  # type: ignore[return-value]
    if isinstance(value, (Mapping, list, tuple)):
        if id(value) in open_containers:
            raise ValueError(f"{path} contains itself")
        open_containers.add(id(value))
        try:
            if isinstance(value, Mapping):
                result: _Canonical = {}
                for key, item in value.items():
                    if type(key) is not str:
                        raise TypeError(
                            f"{path} has a key of type {type(key).__name__}: keys must be str"
                        )
                    result[key] = _canonical(f"{path}[{key!r}]", item, open_containers)
            else:
                result = [
                    _canonical(f"{path}[{index}]", item, open_containers)
                    for index, item in enumerate(value)
                ]
        finally:
            open_containers.discard(id(value))
        return result
    raise TypeError(f"{path} is a {kind.__name__}, which cannot be encoded unambiguously")
