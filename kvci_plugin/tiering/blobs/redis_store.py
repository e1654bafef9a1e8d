"""RedisBlobStore: page blobs in Redis or Valkey, shared by every node that reaches the server.

The same sealed blob bytes as the folder backend (``codec``), one string value per page:

    kvci:blob:<namespace hex[:32]>:<key hex>       the blob
    kvci:blobs                                     sorted set "<ns hex[:32]>:<key hex>" -> written
    kvci:quarantine:<time ns>:<ns hex[:32]>:<key hex>   a blob that failed verification
    kvci:tenant-key:<tenant id>                    a tenant's key material (``tenant_keys``)

A SET replaces a value whole, so two nodes writing the same page at once leave one complete
blob or the other, never a mix, and a writer that dies mid-way leaves nothing. The sorted set
records when each blob was written, so that start-up reconciliation can tell an orphan from a
blob another node is about to record; it is updated in the same MULTI/EXEC transaction as the
blob. Quarantined blobs expire after ``QUARANTINE_TTL_S``.

What a stored blob survives is what the server's persistence gives (RDB snapshots, or AOF with
``appendfsync``): kvci verifies every read, so a blob the server lost is a miss, never wrong KV.

Every request waits at most ``DependencyTimeouts.blob_s`` (connecting: ``connect_s``) and is not
retried; a read the server does not answer in time, or at all, raises
``BlobStoreUnavailableError``: a miss, and the blob stays.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvci_plugin.tiering.blobs.backend import StoredBlob
from kvci_plugin.tiering.blobs.codec import check_namespace, check_page, encode, open_page
from kvci_plugin.tiering.blobs.errors import (
    BlobMissingError,
    BlobStoreUnavailableError,
    BlobUnavailableError,
)
from kvci_plugin.tiering.blobs.parallel import read_prefix, write_each
from kvci_plugin.tiering.blobs.tenant_keys import (
    TOMBSTONE,
    PageSeal,
    RootKeyProvider,
    StateDirRootKey,
    TenantKeys,
)
from kvci_plugin.tiering.timeouts import DependencyTimeouts
from kvci_plugin.tiering.types import (
    PageKey,
    TenantMismatchError,
    check_page_key,
    check_tenant,
)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # an optional dependency: only a redis:// blob_url needs it
    redis = None  # type: ignore[assignment]

QUARANTINE_TTL_S = 7 * 24 * 3600
# Material for a tombstone, in one step (a forget between a read and a write must not be undone).
_RENEW = ("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) end "
          "return redis.call('GET', KEYS[1])")
_INDEX = "kvci:blobs"


def _connect(url: str, timeouts: DependencyTimeouts) -> redis.Redis:
    if redis is None:
        raise RuntimeError(
            "blob_url names Redis but the redis package is missing: pip install 'kvci[shared]'"
        )
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"blob_url must start with redis://, rediss:// or unix://, not {url!r}")
    # No retries: a wait is one timeout at most. A pooled connection the server closed is
    # replaced when it is taken from the pool, so a restarted server costs no failed request.
    # Not pinged: a server down when a worker starts is the disk tier's health to find (the
    # scheduler's tier asks it first), never a reason for the engine not to start.
    return redis.Redis.from_url(
        url, socket_timeout=timeouts.blob_s, socket_connect_timeout=timeouts.connect_s,
        retry=Retry(NoBackoff(), 0))


@contextmanager
def _store_unavailable(what: str) -> Iterator[None]:
    """A server that cannot be reached or does not answer in time says nothing of the blob."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise BlobStoreUnavailableError(f"{what}: {exc}") from exc


class RedisMaterials:
    """Tenant key material as Redis values: created with SET NX (concurrent first writes agree
    on one), replaced by a tombstone with SET, renewed over one by a script."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def read_material(self, tenant_id: str) -> bytes | None:
        with _store_unavailable("reading a tenant's key material"):
            return self._client.get(f"kvci:tenant-key:{tenant_id}")

    def create_material(self, tenant_id: str, material: bytes) -> bytes:
        name = f"kvci:tenant-key:{tenant_id}"
        self._client.set(name, material, nx=True)
        stored = self._client.get(name)
        if stored is None:
            raise BlobUnavailableError("the tenant's key material vanished as it was created")
        return stored

    def renew_material(self, tenant_id: str, material: bytes) -> bytes:
        with _store_unavailable("renewing a tenant's key material"):
            return self._client.eval(_RENEW, 1, f"kvci:tenant-key:{tenant_id}", TOMBSTONE,
                                     material)

    def destroy_material(self, tenant_id: str) -> bool:
        previous = self._client.set(f"kvci:tenant-key:{tenant_id}", TOMBSTONE, get=True)
        return previous not in (None, TOMBSTONE)


def redis_keys(client: redis.Redis, root_key: RootKeyProvider | None) -> TenantKeys:
    return TenantKeys((root_key or StateDirRootKey()).root_key(), RedisMaterials(client))


class RedisBlobRoot:
    """One Redis database as a blob location for every namespace."""

    def __init__(self, url: str, root_key: RootKeyProvider | None = None,
                 timeouts: DependencyTimeouts = DependencyTimeouts()) -> None:
        self._url = url
        self._client = _connect(url, timeouts)
        self._keys = redis_keys(self._client, root_key)

    @property
    def keys(self) -> TenantKeys:
        return self._keys

    def describe(self) -> str:
        # The URL may carry a password: name the server only.
        kwargs = self._client.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        return f"redis {where} db {kwargs.get('db', 0)}"

    def store(self, namespace: bytes) -> RedisBlobStore:
        return RedisBlobStore(self._client, namespace, self._keys)

    def listing(self) -> Iterator[StoredBlob]:
        now = time.time()
        for member, written in self._client.zscan_iter(_INDEX):
            ns_prefix, _, key_hex = member.decode().partition(":")
            yield StoredBlob(ns_prefix, key_hex, max(0.0, now - written))

    def remove(self, blob: StoredBlob) -> None:
        member = f"{blob.namespace_prefix}:{blob.key_hex}"
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(f"kvci:blob:{member}")
            pipe.zrem(_INDEX, member)
            pipe.execute()

    def sweep_temps(self, min_age_s: float) -> int:
        return 0  # a SET is whole or absent: there are no temp values

    def close(self) -> None:
        self._client.close()


class RedisBlobStore:
    """Content-addressed, sealed page blobs of one namespace in Redis. Thread-safe."""

    def __init__(self, client: redis.Redis, namespace: bytes,
                 keys: TenantKeys | None = None) -> None:
        self._client = client
        self._namespace = check_namespace(namespace)
        self._keys = keys or redis_keys(client, None)
        self._ns_prefix = namespace.hex()[:32]

    @classmethod
    def from_url(cls, url: str, namespace: bytes,
                 timeouts: DependencyTimeouts = DependencyTimeouts()) -> RedisBlobStore:
        return cls(_connect(url, timeouts), namespace)

    @property
    def namespace(self) -> bytes:
        return self._namespace

    @property
    def keys(self) -> TenantKeys:
        return self._keys

    def _member(self, key: PageKey) -> str:
        return f"{self._ns_prefix}:{check_page_key(key, 'key').hex()}"

    def _name(self, key: PageKey) -> str:
        return f"kvci:blob:{self._member(key)}"

    def exists(self, key: PageKey) -> bool:
        """Whether a blob is present (not whether it verifies: ``read`` says that)."""
        return bool(self._client.exists(self._name(key)))

    def size(self, key: PageKey) -> int:
        size = self._client.strlen(self._name(key))
        if not size:
            raise BlobMissingError(f"no blob for page {key.hex()}")
        return int(size)

    def delete(self, key: PageKey) -> bool:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._name(key))
            pipe.zrem(_INDEX, self._member(key))
            deleted, _ = pipe.execute()
        return bool(deleted)

    def write(self, key: PageKey, tenant: str, data: torch.Tensor) -> int:
        """Store ``data`` as the blob of ``key``; return the blob's size. Same rules as the
        folder backend: an intact blob of the tenant is kept, a bad one replaced, another
        tenant's refused."""
        check_tenant(tenant)
        data = check_page(data, "data")
        if data.device.type != "cpu":
            raise ValueError(f"data must be on the CPU, not {data.device}")
        if self.exists(key):
            try:
                self.read(key, tenant)
                return self.size(key)
            except BlobUnavailableError:
                pass  # bad, or deleted meanwhile: write it
        blob = encode(self._keys.for_write(tenant, self._namespace), self._namespace, key, data)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self._name(key), blob)
            pipe.zadd(_INDEX, {self._member(key): time.time()})
            pipe.execute()
        return len(blob)

    def write_many(
        self, keys: Sequence[PageKey], tenant: str, pages: torch.Tensor
    ) -> list[int]:
        return write_each(self, keys, tenant, pages)

    def read(self, key: PageKey, tenant: str, out: torch.Tensor | None = None,
             seal: PageSeal | None = None) -> torch.Tensor:
        """The verified page of ``key`` for ``tenant``; see ``BlobStore.read``."""
        check_tenant(tenant)
        if out is not None:
            check_page(out, "out")
        name = self._name(key)
        with _store_unavailable(f"blob of page {key.hex()}"):
            blob = self._client.get(name)
        if blob is None:
            raise BlobMissingError(f"no blob for page {key.hex()}")
        return open_page(blob, self._keys, tenant, self._namespace, key, out,
                         lambda: self._quarantine(key, name, blob), seal)

    def read_many(
        self, keys: Sequence[PageKey], tenant: str, out: torch.Tensor
    ) -> tuple[int, BlobUnavailableError | TenantMismatchError | None]:
        return read_prefix(self, keys, tenant, out)

    def quarantined(self) -> int:
        return sum(1 for _ in self._client.scan_iter(match="kvci:quarantine:*", count=500))

    def _quarantine(self, key: PageKey, name: str, seen: bytes) -> None:
        target = f"kvci:quarantine:{time.time_ns()}:{self._member(key)}"

        def move(pipe: redis.client.Pipeline) -> None:
            # Only the bad value moves: a fresh write since it was read stays where it is.
            if pipe.get(name) != seen:
                return
            pipe.multi()
            pipe.rename(name, target)
            pipe.expire(target, QUARANTINE_TTL_S)
            pipe.zrem(_INDEX, self._member(key))

        try:
            self._client.transaction(move, name)
        except (redis.ResponseError, redis.ConnectionError, redis.TimeoutError):
            return  # vanished meanwhile, or the server failed: the blob is refused either way
