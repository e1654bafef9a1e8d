"""A checkpoint's meta, packed: one bytes object instead of a tree of dicts and lists.

Every checkpoint carries its meta (trigger, the recommendation's dump, refusals...) for
``explain``: ~2.7 KB and dozens of objects each when kept as dicts, which every full garbage
collection on the scheduler thread walked. ``marshal`` packs the plain values the manager keeps
(str, numbers, None, lists, dicts) into one untracked bytes object and gives back equal values;
meta holding anything else is kept as it is.
"""

from __future__ import annotations

import marshal
from collections.abc import Mapping
from typing import Any


def pack_meta(meta: Mapping[str, Any] | None) -> bytes | dict[str, Any]:
    plain = dict(meta or {})
    try:
        return marshal.dumps(plain)
    except ValueError:  # a value marshal cannot write: kept as it was given
        return plain


def unpack_meta(packed: bytes | dict[str, Any]) -> dict[str, Any]:
    """A fresh dict of the meta (the caller may change it)."""
    return marshal.loads(packed) if isinstance(packed, bytes) else dict(packed)
