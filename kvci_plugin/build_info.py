"""What ``kvci_plugin._C`` was built against, as setup.py recorded it in ``_build_info.json``.

Read by the extension's load error (``kvci_plugin.ops._native``) and by ``kvci doctor``. Imports
neither torch nor vLLM: it must explain a torch that does not load, too.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

BUILD_INFO_PATH = Path(__file__).with_name("_build_info.json")

REBUILD = ("rebuild it against this torch, in this environment: pip install --no-build-isolation "
           "--force-reinstall --no-deps <kvci checkout or git URL> (a development checkout: "
           "python setup.py build_ext --inplace, or make setup)")


def read_build_info(path: Path = BUILD_INFO_PATH) -> dict[str, Any] | None:
    """The recorded build, or None when there is none (not built, or built before kvci kept it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe_build(info: dict[str, Any]) -> str:
    """E.g. ``torch 2.13.0+cpu, a CPU build`` or ``torch 2.14.1 (CUDA 13.0), a CUDA build for
    8.0;9.0+PTX``."""
    torch = f"torch {info.get('torch')}"
    if info.get("torch_cuda"):
        torch += f" (CUDA {info['torch_cuda']})"
    if info.get("cuda"):
        arches = info.get("cuda_arch_list")
        return f"{torch}, a CUDA build" + (f" for {arches}" if arches else "")
    return f"{torch}, a CPU build"


def describe_torch(version: str | None, cuda: str | None) -> str:
    """E.g. ``torch 2.13.0+cpu (CPU only)``; ``cuda`` is ``torch.version.cuda``."""
    if version is None:
        return "no torch"
    return f"torch {version}" + (f" (CUDA {cuda})" if cuda else " (CPU only)")


def torch_mismatch(info: dict[str, Any] | None, torch_version: str | None) -> str | None:
    """Why the recorded build does not fit ``torch_version`` (the torch distribution's version),
    or None when it does or nothing was recorded."""
    if info is None or torch_version is None or info.get("torch") == torch_version:
        return None
    return (f"kvci_plugin._C was built for torch {info.get('torch')}, but this environment has "
            f"torch {torch_version}: {REBUILD}")
