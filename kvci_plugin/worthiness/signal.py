"""What one scorer says about one observation."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class SignalKind(str, Enum):
    """How a signal reads in a rationale; aggregation ignores it (polarity is uniform)."""

    OPPORTUNITY = "opportunity"
    RISK = "risk"
    GATE = "gate"


class CheckpointSignal(BaseModel):
    """A scorer's answer.

    ``value`` is in [0, 1] with 1 = more checkpoint-worthy, for every scorer, including the
    conceptually negative ones. ``value=None`` is an abstention: no evidence, so no effect on the
    aggregate. ``veto=True`` forces tier NONE whatever the aggregate.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    kind: SignalKind
    value: Annotated[float, Field(ge=0.0, le=1.0)] | None
    reason: Annotated[str, Field(max_length=500)]
    veto: bool = False
