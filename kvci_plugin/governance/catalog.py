"""The default label source: an operator-maintained catalog of source labels in SQLite.

A source may name the tenants it belongs to (``tenants``): its labels are then resolved for those
tenants only, and for any other it is unlabelled (the gate denies, and its labels are never put
in another tenant's decision). A source that names none is shared: any tenant may cite it.
"""

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
from kvci_plugin.governance.names import check_tenant_name

_SCHEMA = """
CREATE TABLE IF NOT EXISTS source_labels (
    source_id TEXT PRIMARY KEY,
    classification TEXT,
    residency_regions TEXT,  -- JSON array; NULL = undeclared
    retention_days INTEGER,
    mandatory_markings TEXT,  -- JSON array; NULL = undeclared
    updated_at REAL NOT NULL,
    tenants TEXT  -- JSON array of the tenants it belongs to; NULL = shared by every tenant
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
            columns = {row[1] for row in conn.execute("PRAGMA table_info(source_labels)")}
            if "tenants" not in columns:  # a catalog from before sources had owners: all shared
                conn.execute("ALTER TABLE source_labels ADD COLUMN tenants TEXT")

    def resolve(self, source_ids: Sequence[str],
                tenant: str | None = None) -> dict[str, SourceLabels | None]:
        resolved: dict[str, SourceLabels | None] = dict.fromkeys(source_ids)
        unique = list(resolved)
        try:
            with self._connect(read_only=True) as conn:
                for start in range(0, len(unique), _CHUNK):
                    chunk = unique[start : start + _CHUNK]
                    rows = conn.execute(
                        "SELECT source_id, classification, residency_regions, retention_days, "
                        "mandatory_markings, tenants FROM source_labels "
                        f"WHERE source_id IN ({', '.join('?' * len(chunk))})",
                        chunk,
                    ).fetchall()
                    for source_id, *columns, owners in rows:
                        if _visible(owners, tenant):
                            resolved[source_id] = _parse_row(*columns)
        except sqlite3.Error:
            return dict.fromkeys(source_ids)
        return resolved

    def set_labels(self, source_id: str, labels: SourceLabels,
                   tenants: Sequence[str] | None = None) -> None:
        """Record (or replace) the labels of `source_id`; `tenants`: whose source it is (None:
        every tenant's)."""
        self._write({source_id: (labels, _owners(tenants))})

    def remove(self, source_id: str) -> bool:
        """Forget `source_id`'s labels (it then resolves unlabelled). True if it had a row."""
        with self._connect() as conn:
            return (
                conn.execute("DELETE FROM source_labels WHERE source_id = ?", (source_id,)).rowcount
                > 0
            )

    def import_json(self, path_or_obj: str | Path | Mapping[str, Any]) -> int:
        """Import `{source_id: {classification, residency_regions, retention_days,
        mandatory_markings, tenants?}}` from a JSON file or an already-parsed object. Every
        entry is validated before any is written; returns how many were written."""
        document = (
            json.loads(Path(path_or_obj).read_text())
            if isinstance(path_or_obj, (str, Path))
            else path_or_obj
        )
        if not isinstance(document, Mapping):
            raise TypeError(
                "label import must be an object mapping source id to labels, got "
                f"{type(document).__name__}"
            )
        entries: dict[str, tuple[SourceLabels, tuple[str, ...] | None]] = {}
        for source_id, raw in document.items():
            try:
                fields = dict(raw) if isinstance(raw, Mapping) else raw
                tenants = fields.pop("tenants", None) if isinstance(fields, dict) else None
                entries[source_id] = (SourceLabels.model_validate(fields), _owners(tenants))
            except (ValidationError, ValueError, TypeError) as exc:
                raise ValueError(f"labels of source {source_id!r}: {exc}") from exc
        self._write(entries)
        return len(entries)

    def _write(self, entries: Mapping[str, tuple[SourceLabels, tuple[str, ...] | None]]) -> None:
        for source_id in entries:
            if not isinstance(source_id, str) or not source_id:
                raise ValueError(f"source_id must be a non-empty string, got {source_id!r}")
        now = time.time()
        with self._connect() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO source_labels (source_id, classification, "
                "residency_regions, retention_days, mandatory_markings, updated_at, tenants) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        source_id,
                        None if labels.classification is None else labels.classification.value,
                        _json_names(labels.residency_regions),
                        labels.retention_days,
                        _json_names(labels.mandatory_markings),
                        now,
                        None if owners is None else json.dumps(sorted(owners)),
                    )
                    for source_id, (labels, owners) in entries.items()
                ],
            )

    @contextmanager
    def _connect(self, read_only: bool = False) -> Iterator[sqlite3.Connection]:
        # Reads open read-only so that a catalog deleted underneath us reads as an error (every
        # source unlabelled) instead of being silently recreated empty.
        target, uri = (
            (f"{self.path.resolve().as_uri()}?mode=ro", True)
            if read_only
            else (str(self.path), False)
        )
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


def _owners(tenants: Any) -> tuple[str, ...] | None:
    """The tenants a source belongs to, checked by the one tenant-name rule; None: shared."""
    if tenants is None:
        return None
    if isinstance(tenants, str) or not isinstance(tenants, Sequence) or not tenants:
        raise ValueError("tenants must be a non-empty list of tenant names (or left out: shared)")
    return tuple(check_tenant_name(t) for t in tenants)


def _visible(owners: Any, tenant: str | None) -> bool:
    """Whether `tenant` may see a source owned by `owners` (a JSON array, or NULL: shared)."""
    if owners is None:
        return True
    try:
        return tenant is not None and tenant in json.loads(owners)
    except (ValueError, TypeError):
        return False  # a malformed owner list shows the source to no one


def _names_from_json(column: Any) -> Any:
    return None if column is None else json.loads(column)


def _json_names(names: frozenset[str] | None) -> str | None:
    return None if names is None else json.dumps(sorted(names))
