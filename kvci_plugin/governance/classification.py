"""The ordered classification scale that source labels and clearances share."""

from __future__ import annotations

import enum
import functools


@functools.total_ordering
class Classification(enum.Enum):
    """PUBLIC < INTERNAL < CONFIDENTIAL < RESTRICTED. Serialized by name."""

    PUBLIC = "PUBLIC"
    INTERNAL = "INTERNAL"
    CONFIDENTIAL = "CONFIDENTIAL"
    RESTRICTED = "RESTRICTED"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Classification):
            return NotImplemented
        return self.rank < other.rank

    @classmethod
    def parse(cls, name: str) -> Classification:
        """The classification called `name`; ValueError naming the valid names otherwise."""
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(member.value for member in cls)
            raise ValueError(f"unknown classification {name!r}; expected one of {valid}") from None


_RANK = {member: rank for rank, member in enumerate(Classification)}
