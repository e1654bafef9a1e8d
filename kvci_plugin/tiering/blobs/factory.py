"""Which blob backend a configuration names: a folder (local or shared) or Redis/Valkey.

Apart from the backends' interface (``backend``), which both backends import, so that the
interface never imports a backend and no import circle closes through a function body.
"""

from __future__ import annotations

from pathlib import Path

from kvci_plugin.tiering.blobs.backend import BlobRoot
from kvci_plugin.tiering.blobs.tenant_keys import RootKeyProvider
from kvci_plugin.tiering.timeouts import DependencyTimeouts


def open_blob_root(blob_url: str | None, disk_root: Path | None,
                   root_key: RootKeyProvider | None = None,
                   timeouts: DependencyTimeouts = DependencyTimeouts()) -> BlobRoot:
    """The blob location a configuration names: ``blob_url`` (redis://, rediss://, unix://) if
    given, else the folder ``disk_root`` (which may be a shared mount); its blobs sealed under
    ``root_key`` (default: the node's state_dir secret); a Redis server waited for at most
    ``timeouts``."""
    if blob_url is not None:
        from kvci_plugin.tiering.blobs.redis_store import RedisBlobRoot

        return RedisBlobRoot(blob_url, root_key, timeouts)
    if disk_root is None:
        raise ValueError("a blob location needs blob_url or disk_root")
    from kvci_plugin.tiering.blobs.folder import FolderBlobRoot

    return FolderBlobRoot(disk_root, root_key)
