"""How the disk tier's methods wait on its dependencies: each through the tier's ``BoundedCalls``
(at most its timeout, skipped at once while the tier is degraded), or directly on the caller's
thread (a whole checkpoint's blobs, read or written by a caller that is not the engine's step).

The decorated methods' object keeps its ``BoundedCalls`` as ``_calls``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def bounded(what: str, *, when_degraded: bool = False) -> Callable[[F], F]:
    """The method runs through the store's ``BoundedCalls``: at most its timeout, skipped at
    once while the tier is degraded (unless ``when_degraded``), a dependency failure marks it
    degraded."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._calls.run(what, method, self, *args, when_degraded=when_degraded,
                                   **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def direct(method: F) -> F:
    """The method runs on the caller's thread, unbounded, and so do the calls it makes (a
    whole checkpoint's blobs, read or written by a caller that is not the engine's step)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._calls.direct():
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]
