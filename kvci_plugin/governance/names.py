"""Names as they cross a model boundary: tenants, and sets of names (scopes, markings, regions)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, PlainSerializer

TENANT_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"
"""The one rule for a tenant's name, wherever it comes from (a request, a credential, the control
surface): printable ASCII a log, a file name and a URL carry as they are."""

TenantName = Annotated[str, Field(min_length=1, max_length=128, pattern=TENANT_PATTERN)]


def check_tenant_name(tenant: object) -> str:
    """``tenant`` if it follows ``TENANT_PATTERN``; ValueError (TypeError if not a str)
    otherwise."""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
    if not re.fullmatch(TENANT_PATTERN, tenant):
        raise ValueError("a tenant name is 1 to 128 characters of A-Z a-z 0-9 . _ : @ -")
    return tenant


def _check_names(names: frozenset[str]) -> frozenset[str]:
    for name in names:
        if not name or name != name.strip():
            raise ValueError(
                f"names must be non-empty and carry no surrounding whitespace, got {name!r}"
            )
    return names


# Serialized sorted so that a decision's JSON is identical across processes (set order follows
# the per-process string hash seed).
NameSet = Annotated[
    frozenset[str],
    AfterValidator(_check_names),
    PlainSerializer(sorted, return_type=list[str]),
]
