"""Fixtures for the governance tests: real key files, real SQLite, real JWTs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvci_plugin.governance import (
    AlwaysDenyEligibility,
    CredentialConfig,
    CredentialIssuer,
    CredentialVerifier,
    RevocationList,
    UnlabelledResolver,
    set_persistence_eligibility_gate,
    set_source_label_resolver,
    write_hmac_key_file,
)


@pytest.fixture(scope="session")
def hmac_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hmac_key_file(tmp_path_factory.mktemp("keys") / "hs256.key")


@pytest.fixture(scope="session")
def issuer(hmac_key: Path) -> CredentialIssuer:
    return CredentialIssuer.from_key_file("HS256", hmac_key)


@pytest.fixture
def revocations(tmp_path: Path) -> RevocationList:
    return RevocationList(tmp_path / "revocations.db")


@pytest.fixture
def verifier(hmac_key: Path, revocations: RevocationList) -> CredentialVerifier:
    return CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=hmac_key), revocations)


@pytest.fixture(autouse=True)
def _restore_seams() -> Iterator[None]:
    """Each test starts from, and leaves, the shipped defaults (deny everything)."""
    set_persistence_eligibility_gate(AlwaysDenyEligibility())
    set_source_label_resolver(UnlabelledResolver())
    yield
    set_persistence_eligibility_gate(AlwaysDenyEligibility())
    set_source_label_resolver(UnlabelledResolver())


@pytest.fixture(scope="session")
def plain_verifier(hmac_key: Path) -> CredentialVerifier:
    """A verifier with no revocation list, shareable across hypothesis examples."""
    return CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=hmac_key))
