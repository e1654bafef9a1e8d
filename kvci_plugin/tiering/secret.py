"""The deployment secret that keys every prefix key.

Prefix keys are a keyed PRF of the prompt (see ``kvci_plugin.ops.prefix_keys``): without the
secret nobody can predict a key, so a client who chooses prompts cannot construct a collision
with another tenant's prefix. The secret is either configured (``configured``: at least 16 bytes,
e.g. shared by the replicas that share a disk tier) or created on first use as 32 random bytes in
``<state_dir>/secret``: written to a temporary file with mode 0600 in a 0700 folder, fsynced and
linked into place, so concurrent first starts agree on one secret. A secret file with group or
other permission bits, not owned by this user, not a regular file, or shorter than 16 bytes is
refused, never used. Changing the secret changes every key: stored KV becomes unreachable
(misses), never wrong.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from kvci_plugin.ops import MIN_SECRET_BYTES

SECRET_FILE_NAME = "secret"
DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "kvci"
"""The node's state folder unless ``state_dir`` names another."""
SECRET_BYTES = 32


def load_or_create_secret(state_dir: Path, configured: bytes | None = None) -> bytes:
    """The configured secret, else the one stored in ``state_dir`` (created on first use)."""
    if configured is not None:
        if not isinstance(configured, bytes):
            raise TypeError(f"configured secret must be bytes, not {type(configured).__name__}")
        if len(configured) < MIN_SECRET_BYTES:
            raise ValueError(
                f"configured secret must be at least {MIN_SECRET_BYTES} bytes, "
                f"got {len(configured)}"
            )
        return configured
    if not isinstance(state_dir, Path):
        raise TypeError(f"state_dir must be a Path, not {type(state_dir).__name__}")
    _ensure_private_dir(state_dir)
    path = state_dir / SECRET_FILE_NAME
    if not os.path.lexists(path):
        create_once(path, secrets.token_bytes(SECRET_BYTES))
    return read_key_file(path)


def _ensure_private_dir(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = state_dir.stat().st_mode
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(f"kvci state folder {state_dir} is not a folder")
    if mode & 0o022:
        raise PermissionError(
            f"kvci state folder {state_dir} is writable by group or others (mode "
            f"{stat.S_IMODE(mode):04o}); others could replace the secret: chmod 700 it"
        )


def create_once(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` unless it exists: a 0600 temp file, fsynced, linked into place
    (concurrent creators agree on one: the first link wins), the folder fsynced."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), 0o600)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process created it first: everyone uses that one
    finally:
        os.unlink(temporary)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def replace_file(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` whatever is there: a 0600 temp file, fsynced, renamed over it,
    the folder fsynced (a reader sees the old bytes or the new, never a mix)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_key_file(path: Path) -> bytes:
    """The bytes of a key file (at least MIN_SECRET_BYTES) only its owner can read."""
    data = read_secret_file(path)
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(
            f"secret file {path} holds {len(data)} bytes; a secret needs at least "
            f"{MIN_SECRET_BYTES}"
        )
    return data


def read_secret_file(path: Path) -> bytes:
    """The bytes of a secret file that only its owner (this user) can read; refused otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if os.path.islink(path):
            raise PermissionError(f"secret file {path} is a symbolic link: refused") from error
        raise
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"secret file {path} is not a regular file: refused")
        if info.st_uid != os.geteuid():
            raise PermissionError(
                f"secret file {path} is owned by uid {info.st_uid}, not by this user "
                f"({os.geteuid()}): refused"
            )
        if info.st_mode & 0o077:
            raise PermissionError(
                f"secret file {path} has mode {stat.S_IMODE(info.st_mode):04o}; it must be "
                f"readable by its owner only (chmod 600 {path}, and replace the secret if "
                "others may have read it)"
            )
        return file.read()
