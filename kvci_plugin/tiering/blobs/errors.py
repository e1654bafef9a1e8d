"""What a blob read can fail with, in every blob backend: the page is bad, or the store is away.

Its own module, importing nothing of kvci, so that the codec, the tenant keys and every backend
can share these errors without importing one another.
"""

from __future__ import annotations


class BlobUnavailableError(Exception):
    """A page's blob cannot be served: a miss for the caller, never partial or foreign bytes."""


class BlobMissingError(BlobUnavailableError):
    """No blob exists for the key."""


class BlobIntegrityError(BlobUnavailableError):
    """The blob failed verification and was moved to quarantine (or, not being a regular file,
    was refused where it is)."""


class BlobStoreUnavailableError(Exception):
    """The blob store could not be asked (an I/O error, a stale NFS handle, no file descriptor
    left, a Redis server unreachable or too slow): a miss that says nothing of the page.

    Deliberately not a ``BlobUnavailableError``: that says the page is bad, and a bad page is
    quarantined and forgotten by every node. A store that fails for a while must not cost the
    tier its good pages."""
