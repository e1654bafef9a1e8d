"""How session and delegation credentials are verified: one pinned algorithm, one key file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CredentialAlgorithm = Literal["HS256", "RS256", "EdDSA"]


class CredentialConfig(BaseModel):
    """`key_file` holds the HMAC secret for HS256 and the PEM public key for RS256 / EdDSA.

    The algorithm is pinned: a token signed with any other algorithm is refused, which closes
    the classic alg-confusion attacks (HS256 keyed with a public key, alg "none").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: CredentialAlgorithm
    key_file: Path
    audience: str = Field(default="kvci", min_length=1)
    issuer: str | None = Field(default=None, min_length=1)
    # Clock skew tolerated on exp/nbf; kept small because it extends every credential's life.
    leeway_s: float = Field(default=5.0, ge=0.0, le=300.0)
