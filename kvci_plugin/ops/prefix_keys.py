"""Keyed, chained 128-bit keys for the full blocks of a prompt (key format ``kvci-key-v1``).

The construction, for token ids t (each in [0, 2^31)) and block size bs::

    kb || kc = HMAC-SHA256(secret, "kvci-key-v1" 0x00 || u64be(len ns) || ns
                                   || u64be(len tenant) || tenant)        # tenant as UTF-8
    d_j      = SipHash-2-4-128(kb, LE32(t[j*bs]) || ... || LE32(t[j*bs + bs - 1]))
    key_i    = SipHash-2-4-128(kc, d_0 || d_1 || ... || d_i)

A 128-bit SipHash output is the 16 bytes LE64(out0) || LE64(out1); a key is returned as the row
``[out0, out1]`` of a uint64 tensor and ``key_bytes`` gives its 16-byte form, the one the tiers
use, which ``prefix_key_list`` returns straight from a sequence of ids. The hashing runs in
C++ (``csrc/cpu/block_keys.cpp`` explains why it is shaped this way); a trailing partial block
gets no key. Any change here is a new ``KEY_FORMAT``. The secret is the deployment secret
(``kvci_plugin.tiering.secret``); the namespace is a ``namespace_fingerprint``
(``kvci_plugin.tiering.keys``).
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Sequence

import torch

from kvci_plugin.ops._native import kvci_ops, pack_token_ids, prefix_key_bytes

KEY_FORMAT = "kvci-key-v1"
"""Names the key construction above; it is part of every namespace fingerprint."""

MIN_SECRET_BYTES = 16

TokenIds = torch.Tensor | Sequence[int]


def derive_subkeys(namespace: bytes, tenant: str, secret: bytes) -> bytes:
    """The 32 bytes kb || kc that key one (namespace, tenant) under the deployment secret."""
    _check_bytes("namespace", namespace, 1)
    _check_bytes("secret", secret, MIN_SECRET_BYTES)
    tenant_bytes = _tenant(tenant).encode("utf-8")
    message = b"".join(
        (
            KEY_FORMAT.encode("ascii"),
            b"\x00",
            len(namespace).to_bytes(8, "big"),
            namespace,
            len(tenant_bytes).to_bytes(8, "big"),
            tenant_bytes,
        )
    )
    return hmac.digest(secret, message, "sha256")


def prefix_block_keys(
    token_ids: TokenIds, block_size: int, namespace: bytes, tenant: str, secret: bytes
) -> torch.Tensor:
    """Keys of the full blocks of ``token_ids``: a uint64 tensor ``[n_full_blocks, 2]``.

    ``token_ids``: a 1-D int32/int64 tensor or a sequence of int, each id in [0, 2^31).
    """
    _check_block_size(block_size)
    _check_bytes("namespace", namespace, 1)
    _check_bytes("secret", secret, MIN_SECRET_BYTES)
    subkeys = _cached_subkeys_tensor(namespace, _tenant(tenant), secret)
    return kvci_ops.prefix_block_keys(_tokens_tensor(token_ids, "token_ids"), block_size, subkeys)


def prefix_key_list(
    token_ids: Sequence[int], block_size: int, namespace: bytes, tenant: str, secret: bytes
) -> list[bytes]:
    """``key_bytes(prefix_block_keys(...))`` of a sequence of int, in one native call: no tensor
    is made on the way. The scheduler keys every request's prompt this way: making a tensor
    first took several times as long in the engine's scheduler, and what is left is mostly
    reading the Python ints (``benchmarks/bench_prefix_keys.py`` times the keying)."""
    _check_block_size(block_size)
    _check_bytes("namespace", namespace, 1)
    _check_bytes("secret", secret, MIN_SECRET_BYTES)
    if isinstance(token_ids, (str, bytes, bytearray, torch.Tensor)) or not isinstance(
        token_ids, Sequence
    ):
        raise TypeError(f"token_ids must be a sequence of int, not {type(token_ids).__name__}")
    return prefix_key_bytes(
        token_ids, block_size, _cached_subkeys(namespace, _tenant(tenant), secret), "token_ids"
    )


def prefix_block_keys_batched(
    token_ids: Sequence[TokenIds],
    block_size: int,
    namespace: bytes,
    tenants: Sequence[str],
    secret: bytes,
) -> list[torch.Tensor]:
    """``prefix_block_keys`` of many requests (request r keyed for ``tenants[r]``) in one call."""
    _check_block_size(block_size)
    _check_bytes("namespace", namespace, 1)
    _check_bytes("secret", secret, MIN_SECRET_BYTES)
    if isinstance(token_ids, torch.Tensor) or not isinstance(token_ids, Sequence):
        raise TypeError("token_ids must be a sequence with one entry per request")
    if isinstance(tenants, str) or not isinstance(tenants, Sequence):
        raise TypeError("tenants must be a sequence of str, one per request")
    if len(tenants) != len(token_ids):
        raise ValueError(
            f"tenants has {len(tenants)} entries but token_ids has {len(token_ids)} requests"
        )
    subkeys = b"".join(_cached_subkeys(namespace, _tenant(tenant), secret) for tenant in tenants)
    if not token_ids:
        return []
    requests = [_tokens_tensor(t, f"token_ids[{r}]") for r, t in enumerate(token_ids)]
    return kvci_ops.prefix_block_keys_batched(requests, block_size, _bytes_tensor(subkeys))


def key_bytes(keys: torch.Tensor) -> list[bytes]:
    """The 16-byte form of each key row (LE64(out0) || LE64(out1))."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"keys must be a tensor, not {type(keys).__name__}")
    if keys.dtype != torch.uint64 or keys.dim() != 2 or keys.shape[1] != 2:
        raise ValueError(
            f"keys must be a uint64 tensor [n, 2], got {keys.dtype} {tuple(keys.shape)}"
        )
    raw = keys.cpu().contiguous().numpy().astype("<u8", copy=False).tobytes()
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def _check_bytes(name: str, value: object, min_length: int) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, not {type(value).__name__}")
    if len(value) < min_length:
        raise ValueError(
            f"{name} must be at least {min_length} bytes, got {len(value)}"
            if min_length > 1
            else f"{name} must not be empty"
        )


def _check_block_size(block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _tenant(tenant: object) -> str:
    # Also checked before the caches below, so that an unhashable tenant gets a clear error.
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
    if not tenant:
        raise ValueError("tenant must not be empty")
    return tenant


# A few (namespace, tenant) pairs key most calls: derive each once, not per prompt.
@functools.lru_cache(maxsize=1024)
def _cached_subkeys(namespace: bytes, tenant: str, secret: bytes) -> bytes:
    return derive_subkeys(namespace, tenant, secret)


@functools.lru_cache(maxsize=1024)
def _cached_subkeys_tensor(namespace: bytes, tenant: str, secret: bytes) -> torch.Tensor:
    return _bytes_tensor(_cached_subkeys(namespace, tenant, secret))


def _tokens_tensor(token_ids: object, name: str) -> torch.Tensor:
    """A 1-D int32/int64 CPU tensor of the ids; sequences are checked and packed as int32."""
    if isinstance(token_ids, torch.Tensor):
        # CPU kernels always; CUDA kernels where the extension was built with them (else the
        # dispatcher refuses the CUDA tensor by name).
        if token_ids.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{name} must be on the CPU or a CUDA device, got device {token_ids.device}"
            )
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {token_ids.dtype}")
        if token_ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(token_ids.shape)}")
        return token_ids
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"{name} must be a tensor or a sequence of int, not {type(token_ids).__name__}"
        )
    if not token_ids:
        return torch.empty(0, dtype=torch.int32)
    packed = bytearray(4 * len(token_ids))
    pack_token_ids(token_ids, packed, name)
    return torch.frombuffer(packed, dtype=torch.int32)
