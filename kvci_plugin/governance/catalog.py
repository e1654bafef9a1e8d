"""The default label source: an operator-maintained catalog of source labels in SQLite."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvci_plugin.governance.labels import SourceLabels

_SCHEMA = """
CREATE TABLE IF NOT EXISTS source_labels (
    source_id TEXT PRIMARY KEY,
    classification TEXT,
    residency_regions TEXT,  -- JSON array; NULL = undeclared
    retention_days INTEGER,
    mandatory_markings TEXT,  -- JSON array; NULL = undeclared
    updated_at REAL NOT NULL
)
"""
# Far below SQLite's bound-parameter limit.
_CHUNK = 500


class CatalogLabelResolver:
    """Resolves labels from the catalog at `sqlite_path`, created if absent.

    A source with no row, a row that does not parse, or a catalog that cannot be read all come
    back as None (unlabelled), so they refuse at the gate rather than vanish from the answer.
    """

    def __init__(self, sqlite_path: str | Path) -> None:
        self.path = Path(sqlite_path)
        with self._connect() as conn:
            conn.execute(_SCHEMA)

    def resolve(self, source_ids: Sequence[str]) -> dict[str, SourceLabels | None]:
        resolved: dict[str, SourceLabels | None] = dict.fromkeys(source_ids)
        unique = list(resolved)
        try:
            with self._connect(read_only=True) as conn:
                for start in range(0, len(unique), _CHUNK):
                    chunk = unique[start : start + _CHUNK]
                    rows = conn.execute(
                        "SELECT source_id, classification, residency_regions, retention_days, mandatory_markings "
                        f"FROM source_labels WHERE source_id IN ({', '.join('?' * len(chunk))})",
                        chunk,
                    ).fetchall()
                    for source_id, *columns in rows:
                        resolved[source_id] = _parse_row(*columns)
        except sqlite3.Error:
            return dict.fromkeys(source_ids)
        return resolved

    def set_labels(self, source_id: str, labels: SourceLabels) -> None:
        """Record (or replace) the labels of `source_id`."""
        self._write({source_id: labels})

    def remove(self, source_id: str) -> bool:
        """Forget `source_id`'s labels (it then resolves unlabelled). True if it had a row."""
        with self._connect() as conn:
            return conn.execute("DELETE FROM source_labels WHERE source_id = ?", (source_id,)).rowcount > 0

    def import_json(self, path_or_obj: str | Path | Mapping[str, Any]) -> int:
        """Import `{source_id: {classification, residency_regions, retention_days,
        mandatory_markings}}` from a JSON file or an already-parsed object. Every entry is
        validated before any is written; returns how many were written."""
        document = json.loads(Path(path_or_obj).read_text()) if isinstance(path_or_obj, (str, Path)) else path_or_obj
        if not isinstance(document, Mapping):
            raise TypeError(
                f"label import must be an object mapping source id to labels, got {type(document).__name__}"
            )
        entries: dict[str, SourceLabels] = {}
        for source_id, raw in document.items():
            try:
                entries[source_id] = SourceLabels.model_validate(raw)
            except ValidationError as exc:
                raise ValueError(f"labels of source {source_id!r}: {exc}") from exc
        self._write(entries)
        return len(entries)

    def _write(self, entries: Mapping[str, SourceLabels]) -> None:
        for source_id in entries:
            if not isinstance(source_id, str) or not source_id:
                raise ValueError(f"source_id must be a non-empty string, got {source_id!r}")
        now = time.time()
        with self._connect() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO source_labels "
                "(source_id, classification, residency_regions, retention_days, mandatory_markings, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        source_id,
                        None if labels.classification is None else labels.classification.value,
                        _json_names(labels.residency_regions),
                        labels.retention_days,
                        _json_names(labels.mandatory_markings),
                        now,
                    )
                    for source_id, labels in entries.items()
                ],
            )

    @contextmanager
    def _connect(self, read_only: bool = False) -> Iterator[sqlite3.Connection]:
        # Reads open read-only so that a catalog deleted underneath us reads as an error (every
        # source unlabelled) instead of being silently recreated empty.
        target, uri = (f"{self.path.resolve().as_uri()}?mode=ro", True) if read_only else (str(self.path), False)
        with closing(sqlite3.connect(target, uri=uri, timeout=10.0)) as conn, conn:
            yield conn


def _parse_row(
    classification: Any, residency_regions: Any, retention_days: Any, mandatory_markings: Any
) -> SourceLabels | None:
    try:
        return SourceLabels.model_validate(
            {
                "classification": classification,
                "residency_regions": _names_from_json(residency_regions),
                "retention_days": retention_days,
                "mandatory_markings": _names_from_json(mandatory_markings),
            }
        )
    except (ValueError, TypeError):
        # An operator's malformed row reads as unlabelled: it must refuse, not crash or vanish.
        return None


def _names_from_json(column: Any) -> Any:
    return None if column is None else json.loads(column)


def _json_names(names: frozenset[str] | None) -> str | None:
    return None if names is None else json.dumps(sorted(names))
