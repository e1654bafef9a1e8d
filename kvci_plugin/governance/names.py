"""Sets of names (scopes, markings, regions) as they cross a model boundary."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, PlainSerializer


def _check_names(names: frozenset[str]) -> frozenset[str]:
    for name in names:
        if not name or name != name.strip():
            raise ValueError(f"names must be non-empty and carry no surrounding whitespace, got {name!r}")
    return names


# Serialized sorted so that a decision's JSON is identical across processes (set order follows
# the per-process string hash seed).
NameSet = Annotated[
    frozenset[str],
    AfterValidator(_check_names),
    PlainSerializer(sorted, return_type=list[str]),
]
