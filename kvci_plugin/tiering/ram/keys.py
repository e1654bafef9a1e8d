"""Checks of what the RAM index is given: counts, and the page keys of every call."""

from __future__ import annotations

from collections.abc import Iterable

from kvci_plugin.ops._native import KeyTable
from kvci_plugin.tiering.types import PageKey, check_page_key


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, not {value}")
    return value


def check_keys(keys: Iterable[object]) -> tuple[PageKey, ...]:
    if isinstance(keys, (bytes, str)):
        raise TypeError("keys must be a sequence of 16-byte page keys, not a single bytes/str")
    keys = tuple(keys)
    # Every lookup, pin and unpin checks a prompt's keys: one native pass, then the key-by-key
    # check for its precise error.
    try:
        KeyTable.check(keys)
    except TypeError:
        return tuple(check_page_key(k) for k in keys)
    return keys  # type: ignore[return-value]


def slots_in(name: str, value: object, slot_bytes: int) -> int | None:
    """A bound of ``value`` bytes in whole slots; None: no bound. One under a slot is refused."""
    if value is None:
        return None
    n = positive_int(name, value)
    if n < slot_bytes:
        raise ValueError(f"{name} ({n}) is smaller than one slot ({slot_bytes} bytes)")
    return n // slot_bytes
