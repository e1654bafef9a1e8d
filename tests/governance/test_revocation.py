from __future__ import annotations

from pathlib import Path

import pytest

from kvci_plugin.governance import RevocationList


def test_revocation_is_visible_to_another_instance_on_the_same_file(tmp_path: Path) -> None:
    writer = RevocationList(tmp_path / "r.db")
    reader = RevocationList(tmp_path / "r.db")
    assert not reader.is_revoked("j1")
    writer.revoke("j1", "compromised")
    assert reader.is_revoked("j1")
    assert reader.reason("j1") == "compromised"
    assert not reader.is_revoked("j2")


def test_revoking_twice_keeps_the_first_reason(tmp_path: Path) -> None:
    revocations = RevocationList(tmp_path / "r.db")
    revocations.revoke("j1", "first")
    revocations.revoke("j1", "second")
    assert revocations.reason("j1") == "first"


@pytest.mark.parametrize(("jti", "reason", "field"), [("", "why", "jti"), ("j1", "", "reason")])
def test_empty_values_are_rejected(tmp_path: Path, jti: str, reason: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RevocationList(tmp_path / "r.db").revoke(jti, reason)
