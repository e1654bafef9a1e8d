"""The JSON reports of one format in a results folder: what ``render_results`` renders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def reports_of(results: Path, report_format: str) -> list[tuple[Path, dict[str, Any]]]:
    """The reports in ``results`` whose ``report_format`` is ``report_format``, by file name."""
    found = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("report_format") == report_format:
            found.append((path, data))
    return found
