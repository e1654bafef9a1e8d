"""Where source labels come from: the resolver protocol and the deny-everything default."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvci_plugin.governance.labels import SourceLabels


@runtime_checkable
class SourceLabelResolver(Protocol):
    def resolve(self, source_ids: Sequence[str],
                tenant: str | None = None) -> dict[str, SourceLabels | None]:
        """Labels for every id in `source_ids`, as `tenant` may see them. A source that cannot
        be read, or that belongs to another tenant, maps to None (unlabelled): it is never
        omitted, because a reader that returns fewer rows is exactly how a gate fails open on a
        degraded store; and another tenant's labels are never told."""
        ...


class UnlabelledResolver:
    """Knows no labels: every source comes back unlabelled, so nothing is persistable."""

    def resolve(self, source_ids: Sequence[str],
                tenant: str | None = None) -> dict[str, SourceLabels | None]:
        return dict.fromkeys(source_ids)
