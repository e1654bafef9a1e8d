"""The control surface's bearer tokens: one for the operator, one for tenants.

Unless configured (`control_token_file`, `control_tenant_token_file`), each is generated into the
state folder at the control surface's first start: 32 random bytes (URL-safe text), a 0600 file in
a 0700 folder, written under a temporary name, fsynced and linked into place (concurrent first
starts agree on one), and printed once, on the engine's standard error. Reading one refuses a
symbolic link, a file not owned by this user or accessible by group or others, and a token of
fewer than 16 bytes or not printable ASCII.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

MIN_TOKEN_BYTES = 16
TOKEN_BYTES = 32
OPERATOR_TOKEN_NAME = "control-operator.token"
TENANT_TOKEN_NAME = "control-tenant.token"
# The connector's default `state_dir` (kvci_plugin.tiering.secret.DEFAULT_STATE_DIR, which imports
# torch): the command line finds the tokens there without importing the engine's stack.
DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "kvci"


def operator_token_path(state_dir: Path) -> Path:
    return state_dir / OPERATOR_TOKEN_NAME


def tenant_token_path(state_dir: Path) -> Path:
    return state_dir / TENANT_TOKEN_NAME


def ensure_token_file(path: Path) -> str | None:
    """Create ``path`` holding a fresh token unless it exists. The token when this call created
    it (the caller prints it, once), else None."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = folder.stat().st_mode
    if mode & 0o022:
        raise ValueError(f"the folder of {path} is writable by group or others (mode "
                         f"{stat.S_IMODE(mode):04o}): others could replace the token; chmod 700 it")
    if os.path.lexists(path):
        return None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), 0o600)
            file.write(token + "\n")
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return None  # another start created it first: everyone uses that one
    finally:
        os.unlink(temporary)
    return token


def load_bearer_token(path: Path) -> bytes:
    """The bearer token in ``path``: at least 16 printable ASCII bytes, in a regular file this
    user owns and only this user may read. ValueError (naming the file and the way out)
    otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        what = "is a symbolic link" if os.path.islink(path) else exc.strerror
        raise ValueError(f"control token file {path}: {what}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"control token file {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ValueError(
                f"control token file {path} is owned by uid {info.st_uid}, not by this user"
            )
        if info.st_mode & 0o077:
            raise ValueError(
                f"control token file {path} is accessible by group or others (chmod 600 it, "
                "and replace the token if others may have read it)"
            )
        token = file.read(4096).strip()
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"control token file {path} holds fewer than {MIN_TOKEN_BYTES} bytes")
    if any(b <= 0x20 or b >= 0x7F for b in token):
        raise ValueError(f"control token file {path} must hold one printable ASCII token")
    return token
