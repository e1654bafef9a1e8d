"""tools/check_vllm.py, the checker of the vLLM minors CI cannot run as an engine: which tests it
runs over their sources, and how it skips a minor whose wheel cannot be fetched (the checks
themselves run in `make test`, where the wheels can be fetched)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checker():
    path = ROOT / "tools" / "check_vllm.py"
    spec = importlib.util.spec_from_file_location("kvci_check_vllm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tests_run_over_the_sources_are_those_reaching_vllm(checker):
    selected = set(checker.vllm_reaching_tests())
    for reaches in ("tests/connector/test_connector_contract.py",  # vllm itself
                    "tests/connector/test_connector_hooks_034.py",
                    "tests/connector/test_worker_release.py",  # kvci_plugin.connector's package
                    "tests/lmcache/test_lmcache_plumbing.py", "tests/test_plugin.py"):
        assert reaches in selected, reaches
    for never in ("tests/worthiness/test_request_history.py", "tests/test_layering.py"):
        assert never not in selected, never


def test_a_minor_whose_wheel_cannot_be_fetched_is_skipped_by_name(checker, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.setattr(checker, "WHEELS", tmp_path / "wheels")  # nothing cached
    # Nothing reachable: no configured mirror or wheel folder either.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    assert checker.main(["--minor", "0.34", "--contract-only"]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED vllm 0.34: the wheel could not be fetched (vllm==0.34.*" in out
    assert "OK, with minors SKIPPED" in out
    assert checker.main(["--minor", "0.34", "--contract-only", "--require"]) == 2
    assert "FAILED" in capsys.readouterr().out
