from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from kvci_plugin.governance import (
    CredentialConfig,
    CredentialVerifier,
    KeyFileError,
    load_signing_key,
    load_verification_key,
    write_ed25519_key_pair,
    write_hmac_key_file,
)


def test_written_hmac_key_is_private_and_loads(tmp_path: Path) -> None:
    path = write_hmac_key_file(tmp_path / "k")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 32
    assert load_verification_key("HS256", path) == path.read_bytes()


def test_hmac_key_is_not_overwritten(tmp_path: Path) -> None:
    path = write_hmac_key_file(tmp_path / "k")
    with pytest.raises(FileExistsError):
        write_hmac_key_file(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_hmac_key_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_hmac_key_file(tmp_path / "k")
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match="accessible by group or others"):
        CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=path))


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=tmp_path / "absent"))


def test_directory_as_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_verification_key("HS256", tmp_path)


def test_short_hmac_secret_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 16)
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match="16 bytes"):
        load_verification_key("HS256", path)


def test_pem_key_is_refused_as_hmac_secret(tmp_path: Path) -> None:
    # A public key used as an HMAC secret is the classic algorithm-confusion forgery.
    _, public = write_ed25519_key_pair(tmp_path / "priv.pem", tmp_path / "pub.pem")
    os.chmod(public, 0o600)
    with pytest.raises(KeyFileError, match="usable HS256 key"):
        load_verification_key("HS256", public)


def test_ed25519_pair_loads_each_half_for_its_role(tmp_path: Path) -> None:
    private, public = write_ed25519_key_pair(tmp_path / "priv.pem", tmp_path / "pub.pem")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    load_verification_key("EdDSA", public)
    load_signing_key("EdDSA", private)
    with pytest.raises(KeyFileError, match="public key"):
        load_verification_key("EdDSA", private)
    os.chmod(public, 0o600)
    with pytest.raises(KeyFileError, match="private key"):
        load_signing_key("EdDSA", public)


def test_group_writable_public_key_is_refused(tmp_path: Path) -> None:
    _, public = write_ed25519_key_pair(tmp_path / "priv.pem", tmp_path / "pub.pem")
    os.chmod(public, 0o664)
    with pytest.raises(KeyFileError, match="writable by group or others"):
        load_verification_key("EdDSA", public)


def test_key_of_the_wrong_algorithm_is_refused(tmp_path: Path) -> None:
    _, public = write_ed25519_key_pair(tmp_path / "priv.pem", tmp_path / "pub.pem")
    with pytest.raises(KeyFileError, match="RS256"):
        load_verification_key("RS256", public)


def test_short_rsa_key_is_refused(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    path = tmp_path / "rsa1024.pem"
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="1024 bits"):
        load_verification_key("RS256", path)


def test_config_rejects_unknown_algorithm_and_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="algorithm"):
        CredentialConfig(algorithm="none", key_file=tmp_path / "k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="leeway_s"):
        CredentialConfig(algorithm="HS256", key_file=tmp_path / "k", leeway_s=-1)
    with pytest.raises(ValueError, match="verify"):
        CredentialConfig(algorithm="HS256", key_file=tmp_path / "k", verify=False)  # type: ignore[call-arg]
