"""Builds the native extension ``kvci_plugin._C``.

C++ sources under ``csrc/cpu`` always; CUDA sources under ``csrc/cuda`` only in a CUDA build.
``KVCI_CUDA`` chooses: ``auto`` (default: CUDA when torch has CUDA and nvcc is found), ``1``
(require it: a clear error otherwise), ``0`` (C++ only).
"""

import glob
import os
import shutil

from setuptools import setup


def _want_cuda() -> bool:
    import torch
    from torch.utils import cpp_extension

    mode = os.environ.get("KVCI_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"KVCI_CUDA must be auto, 0 or 1, not {mode!r}")
    have_nvcc = cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    have = torch.version.cuda is not None and have_nvcc
    if mode == "1" and not have:
        raise SystemExit(
            "KVCI_CUDA=1 but this torch has no CUDA "
            f"(torch.version.cuda={torch.version.cuda!r}) or nvcc was not found"
        )
    return have if mode == "auto" else mode == "1"


def _extensions():
    from torch.utils import cpp_extension

    here = os.path.dirname(os.path.abspath(__file__))
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # No -std: torch's cpp_extension sets the standard its headers need (C++20 since 2.14).
    cxx_flags = ["-O3", "-fvisibility=hidden"]
    if _want_cuda():
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        return [
            cpp_extension.CUDAExtension(
                "kvci_plugin._C",
                cpu_sources + cuda_sources,
                include_dirs=[os.path.join(here, "csrc")],
                define_macros=[("KVCI_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            )
        ]
    return [
        cpp_extension.CppExtension(
            "kvci_plugin._C",
            cpu_sources,
            include_dirs=[os.path.join(here, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
        )
    ]


def _build_ext():
    from torch.utils import cpp_extension

    return cpp_extension.BuildExtension.with_options(use_ninja=True)


setup(ext_modules=_extensions(), cmdclass={"build_ext": _build_ext()})
