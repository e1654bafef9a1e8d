"""The linter, as `make test` runs it: `ruff check` over the code, configured in pyproject.toml.

The rule set and its exceptions are `[tool.ruff]` in pyproject.toml; ruff is in the `test` extra,
so `make setup` installs it beside pytest. The test runs the ruff of this interpreter's
environment (``python -m ruff``) and fails with ruff's own report.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("kvci_plugin", "tests", "benchmarks", "tools")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_ruff_finds_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
         *CHECKED],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    if "No module named ruff" in done.stderr:
        raise AssertionError(
            f"ruff is not installed in {sys.prefix}: `make setup` installs the test extra, or "
            f"{sys.executable} -m pip install ruff")
    assert done.returncode == 0, f"ruff check {' '.join(CHECKED)}:\n{done.stdout}{done.stderr}"


def test_the_setup_installs_ruff_and_long_lines_count() -> None:
    pyproject = _pyproject()
    test_extra = pyproject["project"]["optional-dependencies"]["test"]
    assert any(req.split(">")[0].split("=")[0].strip() == "ruff" for req in test_extra)
    ruff = pyproject["tool"]["ruff"]
    assert ruff["line-length"] == 100
    lint = ruff["lint"]
    assert "E" in lint["select"] and "E501" not in lint.get("ignore", [])
