"""Who may reach the control surface: loopback by default, a bearer token anywhere else."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

MIN_TOKEN_BYTES = 16


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals; any other name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token_file: Path | None) -> None:
    """Refuse to serve a non-loopback address without a bearer token."""
    if token_file is None and not is_loopback(host):
        raise ValueError(
            f"kvci control_host {host!r} is not a loopback address: serving it needs "
            "control_token_file (a bearer token every call must present)")


def load_bearer_token(path: Path) -> bytes:
    """The bearer token in `path`: at least 16 bytes, readable by its owner only."""
    try:
        mode = path.stat().st_mode
        token = path.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"control_token_file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"control_token_file {path} is accessible by group or others (chmod 600 it)")
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"control_token_file {path} holds fewer than {MIN_TOKEN_BYTES} bytes")
    if any(b <= 0x20 or b >= 0x7F for b in token):
        raise ValueError(f"control_token_file {path} must hold one printable ASCII token")
    return token
