from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvci_plugin.tiering.secret import SECRET_BYTES, load_or_create_secret

REPO_ROOT = Path(__file__).resolve().parents[2]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_on_first_use_then_reused(tmp_path: Path) -> None:
    state = tmp_path / "state" / "kvci"
    secret = load_or_create_secret(state)
    assert len(secret) == SECRET_BYTES == 32
    assert (state / "secret").read_bytes() == secret
    assert mode_of(state / "secret") == 0o600
    assert mode_of(state) == 0o700
    assert load_or_create_secret(state) == secret
    assert sorted(p.name for p in state.iterdir()) == ["secret"]
    assert load_or_create_secret(tmp_path / "other") != secret


def test_another_process_reads_the_same_secret(tmp_path: Path) -> None:
    secret = load_or_create_secret(tmp_path)
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from kvci_plugin.tiering.secret import load_or_create_secret
        print(load_or_create_secret(Path({str(tmp_path)!r})).hex())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == secret.hex()


@pytest.mark.parametrize("attempt", range(5))
def test_concurrent_first_uses_agree(tmp_path: Path, attempt: int) -> None:
    state = tmp_path / f"state{attempt}"
    barrier = threading.Barrier(8)
    results: list[bytes] = []

    def first_use() -> None:
        barrier.wait()
        results.append(load_or_create_secret(state))

    workers = [threading.Thread(target=first_use) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert (state / "secret").read_bytes() == results[0]
    assert sorted(p.name for p in state.iterdir()) == ["secret"]


def test_configured_secret_is_used_and_nothing_is_written(tmp_path: Path) -> None:
    configured = b"c" * 16
    assert load_or_create_secret(tmp_path / "state", configured) == configured
    assert not (tmp_path / "state").exists()
    with pytest.raises(ValueError, match="configured secret must be at least 16 bytes, got 15"):
        load_or_create_secret(tmp_path, b"c" * 15)
    with pytest.raises(TypeError, match="configured secret must be bytes"):
        load_or_create_secret(tmp_path, "c" * 32)  # type: ignore[arg-type]


def write_secret(folder: Path, data: bytes, mode: int) -> Path:
    path = folder / "secret"
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o700 | 0o001])
def test_loose_permissions_are_refused(tmp_path: Path, mode: int) -> None:
    path = write_secret(tmp_path, b"s" * 32, mode)
    with pytest.raises(PermissionError, match=f"has mode {mode:04o}.*chmod 600"):
        load_or_create_secret(tmp_path)
    assert path.read_bytes() == b"s" * 32


def test_a_stored_secret_of_any_length_from_16_is_used(tmp_path: Path) -> None:
    write_secret(tmp_path, b"k" * 16, 0o600)
    assert load_or_create_secret(tmp_path) == b"k" * 16
    write_secret(tmp_path, b"k" * 64, 0o400)
    assert load_or_create_secret(tmp_path) == b"k" * 64


def test_short_secret_file_is_refused(tmp_path: Path) -> None:
    write_secret(tmp_path, b"s" * 15, 0o600)
    with pytest.raises(ValueError, match="holds 15 bytes; a secret needs at least 16"):
        load_or_create_secret(tmp_path)
    write_secret(tmp_path, b"", 0o600)
    with pytest.raises(ValueError, match="holds 0 bytes"):
        load_or_create_secret(tmp_path)


def test_symlink_is_refused(tmp_path: Path) -> None:
    target = write_secret(tmp_path, b"s" * 32, 0o600)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "secret").symlink_to(target)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        load_or_create_secret(state)


def test_non_regular_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "secret", 0o600)
    with pytest.raises(PermissionError, match="not a regular file"):
        load_or_create_secret(tmp_path)


def test_folder_writable_by_others_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by group or others.*chmod 700"):
        load_or_create_secret(state)
    assert not (state / "secret").exists()


def test_state_dir_must_be_a_folder_path(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="state_dir must be a Path"):
        load_or_create_secret(str(tmp_path))  # type: ignore[arg-type]
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(FileExistsError):
        load_or_create_secret(tmp_path / "file")
