"""Makes `lmcache_support` importable by name under either pytest import mode.

This folder must never become a package: with `tests` on sys.path, a `tests/lmcache/__init__.py`
would shadow the real `lmcache`.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
