"""Key files: loading them safely for verification and signing, and writing new ones."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed448, ed25519, rsa

from kvci_plugin.governance.credential_config import CredentialAlgorithm

_PUBLIC_TYPES: dict[str, tuple[type, ...]] = {
    "RS256": (rsa.RSAPublicKey,),
    "EdDSA": (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey),
}
_PRIVATE_TYPES: dict[str, tuple[type, ...]] = {
    "RS256": (rsa.RSAPrivateKey,),
    "EdDSA": (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey),
}


class KeyFileError(ValueError):
    """A key file that is missing, unreadable, too widely accessible, or of the wrong kind."""


def load_verification_key(algorithm: CredentialAlgorithm, path: Path) -> Any:
    """The key that verifies `algorithm` signatures: the HMAC secret, or a PEM public key."""
    if algorithm == "HS256":
        return _prepare(algorithm, path, _read_secret(path))
    raw = _read(path)
    # A public key is not secret, but whoever can rewrite it can mint credentials.
    _refuse_mode(path, stat.S_IWGRP | stat.S_IWOTH, "writable by group or others")
    key = _prepare(algorithm, path, raw)
    if not isinstance(key, _PUBLIC_TYPES[algorithm]):
        raise KeyFileError(
            f"key file {path} must hold a {algorithm} PEM public key, found {type(key).__name__}"
        )
    return key


def load_signing_key(algorithm: CredentialAlgorithm, path: Path) -> Any:
    """The key that signs `algorithm` credentials: the HMAC secret, or a PEM private key."""
    key = _prepare(algorithm, path, _read_secret(path))
    if algorithm != "HS256" and not isinstance(key, _PRIVATE_TYPES[algorithm]):
        raise KeyFileError(
            f"key file {path} must hold a {algorithm} PEM private key, found {type(key).__name__}"
        )
    return key


def write_hmac_key_file(path: Path) -> Path:
    """Create `path` (mode 0600, must not exist) holding a fresh 32-byte HS256 secret."""
    _write_new(path, secrets.token_bytes(32), 0o600)
    return path


def write_ed25519_key_pair(private_path: Path, public_path: Path) -> tuple[Path, Path]:
    """Create a fresh Ed25519 key pair as PEM files: the private one 0600, the public one 0644."""
    private_key = ed25519.Ed25519PrivateKey.generate()
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(private_path, private_pem, 0o600)
    _write_new(public_path, public_pem, 0o644)
    return private_path, public_path


def _read_secret(path: Path) -> bytes:
    raw = _read(path)
    _refuse_mode(path, stat.S_IRWXG | stat.S_IRWXO, "accessible by group or others (chmod 600 it)")
    return raw


def _read(path: Path) -> bytes:
    try:
        if not path.is_file():
            raise KeyFileError(f"key file {path} does not exist or is not a regular file")
        return path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from exc


def _refuse_mode(path: Path, forbidden: int, why: str) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & forbidden:
        raise KeyFileError(f"key file {path} has mode {mode:#o}: {why}")


def _prepare(algorithm: CredentialAlgorithm, path: Path, raw: bytes) -> Any:
    alg = jwt.get_algorithm_by_name(algorithm)
    try:
        key = alg.prepare_key(raw)
    except (jwt.InvalidKeyError, ValueError, TypeError) as exc:
        raise KeyFileError(
            f"key file {path} does not hold a usable {algorithm} key: {exc}"
        ) from exc
    too_short = alg.check_key_length(key)
    if too_short:
        raise KeyFileError(f"key file {path}: {too_short}")
    return key


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    # O_CREAT's mode is filtered through the umask; set it exactly.
    os.chmod(path, mode)
