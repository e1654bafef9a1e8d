"""Fixtures of the blob-location tests: each runs on a folder and on a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_support import Location


@pytest.fixture(params=["folder", "redis"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Location]:
    if request.param == "folder":
        yield Location("folder", str(tmp_path / "shared"))
    else:
        yield Location("redis", request.getfixturevalue("redis_db_url"))
