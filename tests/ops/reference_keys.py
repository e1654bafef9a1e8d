"""A pure-Python kvci-key-v1: the slow, obvious form of the key construction, for tests only.

SipHash-2-4-128 follows the specification (Aumasson & Bernstein, 2012) and its reference code's
128-bit mode; ``test_siphash_reference`` checks it against the published vectors.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

MASK64 = (1 << 64) - 1
MAX_TOKEN_ID = (1 << 31) - 1


def _rotl(x: int, bits: int) -> int:
    return ((x << bits) | (x >> (64 - bits))) & MASK64


def siphash24_128(key: bytes, message: bytes) -> bytes:
    assert len(key) == 16
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:], "little")
    v = [
        0x736F6D6570736575 ^ k0,
        0x646F72616E646F6D ^ k1 ^ 0xEE,
        0x6C7967656E657261 ^ k0,
        0x7465646279746573 ^ k1,
    ]

    def sipround() -> None:
        v[0] = (v[0] + v[1]) & MASK64
        v[1] = _rotl(v[1], 13) ^ v[0]
        v[0] = _rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & MASK64
        v[3] = _rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & MASK64
        v[3] = _rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & MASK64
        v[1] = _rotl(v[1], 17) ^ v[2]
        v[2] = _rotl(v[2], 32)

    def compress(m: int) -> None:
        v[3] ^= m
        sipround()
        sipround()
        v[0] ^= m

    whole = len(message) - len(message) % 8
    for i in range(0, whole, 8):
        compress(int.from_bytes(message[i : i + 8], "little"))
    compress(((len(message) & 0xFF) << 56) | int.from_bytes(message[whole:], "little"))
    v[2] ^= 0xEE
    for _ in range(4):
        sipround()
    out0 = v[0] ^ v[1] ^ v[2] ^ v[3]
    v[1] ^= 0xDD
    for _ in range(4):
        sipround()
    out1 = v[0] ^ v[1] ^ v[2] ^ v[3]
    return out0.to_bytes(8, "little") + out1.to_bytes(8, "little")


def reference_subkeys(namespace: bytes, tenant: str, secret: bytes) -> tuple[bytes, bytes]:
    tenant_bytes = tenant.encode("utf-8")
    message = (
        b"kvci-key-v1\x00"
        + len(namespace).to_bytes(8, "big")
        + namespace
        + len(tenant_bytes).to_bytes(8, "big")
        + tenant_bytes
    )
    derived = hmac.new(secret, message, hashlib.sha256).digest()
    return derived[:16], derived[16:]


def reference_prefix_keys(
    token_ids: Sequence[int], block_size: int, namespace: bytes, tenant: str, secret: bytes
) -> list[bytes]:
    """key_i = SipHash(kc, d_0 || ... || d_i), d_j = SipHash(kb, LE32 tokens of block j)."""
    assert all(0 <= t <= MAX_TOKEN_ID for t in token_ids)
    kb, kc = reference_subkeys(namespace, tenant, secret)
    digests = b""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digests += siphash24_128(kb, b"".join(t.to_bytes(4, "little") for t in block))
        keys.append(siphash24_128(kc, digests))
    return keys
