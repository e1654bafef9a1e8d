"""Memoisation for scorers that are pure functions of a few small values.

The connector scores every finished request and the same counts recur, so a scorer whose
signal depends only on a handful of small ints, flags or labels builds each distinct signal
once. Signals are immutable, so sharing one between recommendations is safe.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

# Distinct inputs remembered per scorer: a few hundred KiB at most across the default set.
SIGNAL_CACHE_SIZE = 1024

_F = TypeVar("_F", bound=Callable[..., object])


def memoised(function: _F) -> _F:
    # typed: 1 and 1.0 (or True) are different inputs and may format differently in a reason.
    return lru_cache(maxsize=SIGNAL_CACHE_SIZE, typed=True)(function)  # type: ignore[return-value]
