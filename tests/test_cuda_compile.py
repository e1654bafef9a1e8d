"""Every CUDA source compiles, on machines without a GPU too: a kernel that does not build fails CI.

The kernels are plain CUDA C++ behind a small C API (``csrc/cuda/*.h``); only the torch bindings
(``csrc/cuda/*_binding.cpp``) see torch, and they build in CUDA builds alone. That split is what
lets ``nvcc -c`` check the kernels beside a CPU-only torch; the bindings are checked against the
headers of a CUDA torch wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"
CUDA_SOURCES = sorted(REPO.glob("csrc/**/*.cu")) + sorted(REPO.glob("benchmarks/**/*.cu"))
C_API_HEADERS = sorted((CSRC / "cuda").glob("*.h"))
# Hopper, the GPUs kvci is measured on; the kernels use nothing newer than sm_70.
ARCH = "sm_90"
NVCC_FLAGS = [f"-arch={ARCH}", "--Werror", "all-warnings", "-Xcompiler", "-Wall"]
# The build takes torch's standard: C++17 in torch 2.11 (the GPU machine's), C++20 from 2.13.
STANDARDS = ("c++17", "c++20")

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(
    NVCC is None,
    reason="nvcc not found (no CUDA toolkit): the CUDA sources cannot be compile-checked",
)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.fixture(scope="module")
def compiled(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[Path, str], subprocess.CompletedProcess[str]]:
    """Compiles every CUDA source under each standard at once (nvcc runs are independent):
    (source, standard) -> result."""
    assert NVCC is not None
    out = tmp_path_factory.mktemp("nvcc")
    running = {
        (source, std): subprocess.Popen(
            [
                NVCC,
                "-c",
                f"-std={std}",
                *NVCC_FLAGS,
                "-I",
                str(CSRC),
                "-o",
                str(out / f"{i}-{std}.o"),
                str(source),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, source in enumerate(CUDA_SOURCES)
        for std in STANDARDS
    }
    results = {}
    for key, process in running.items():
        output, _ = process.communicate(timeout=300)
        results[key] = subprocess.CompletedProcess(process.args, process.returncode, output)
    return results


def test_the_kernels_behind_the_bindings_are_checked() -> None:
    assert {_rel(p) for p in CUDA_SOURCES} >= {"csrc/cuda/pages.cu", "csrc/cuda/prefix_keys.cu"}


@needs_nvcc
@pytest.mark.parametrize("std", STANDARDS)
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=_rel)
def test_cuda_source_compiles(
    source: Path, std: str, compiled: dict[tuple[Path, str], subprocess.CompletedProcess[str]]
) -> None:
    result = compiled[(source, std)]
    assert result.returncode == 0, f"nvcc -std={std} failed on {_rel(source)}:\n{result.stdout}"


@needs_nvcc
@pytest.mark.parametrize("header", C_API_HEADERS, ids=_rel)
def test_c_api_header_compiles_as_host_cpp(header: Path, tmp_path: Path) -> None:
    # The bindings include these headers through the host compiler, which nvcc drives for C++.
    source = tmp_path / "includer.cpp"
    source.write_text(f'#include "{header.relative_to(CSRC)}"\n')
    _host_compile(source, tmp_path / "includer.o", "-std=c++17")


def _host_compile(source: Path, output: Path, *flags: str) -> None:
    """Compile C++ ``source`` as nvcc's host compiler does, warnings as errors."""
    assert NVCC is not None
    result = subprocess.run(
        [NVCC, "-x", "c++", "-c", "-Xcompiler", "-Wall,-Werror", "-I", str(CSRC), *flags,
         "-o", str(output), str(source)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


@pytest.mark.parametrize("source", [*CUDA_SOURCES, *C_API_HEADERS], ids=_rel)
def test_kernels_do_not_include_torch(source: Path) -> None:
    # Such a kernel builds on a CUDA machine and then fails every CPU CI run: say why up front.
    # Project headers that a kernel includes count too.
    seen: set[Path] = set()
    pending = [source]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _INCLUDE.findall(path.read_text()):
            assert not name.startswith(("torch/", "ATen/", "c10/")), f"{_rel(path)} includes {name}"
            local = CSRC / name
            if local.is_file():
                pending.append(local)


# The bindings include torch's CUDA headers, which a CPU torch wheel lacks: check them against the
# headers of a CUDA torch wheel instead (the wheel is fetched once, ~0.5 GB, and only its ~40 MB
# of headers are kept; nothing is installed).
# 2.14.1 is the CUDA (cu130, like this nvcc) build that pip reaches on the machines this runs on.
CUDA_TORCH = "torch==2.14.1"
BINDINGS = sorted((CSRC / "cuda").glob("*_binding.cpp"))
HEADERS_CACHE = REPO / "build" / "cuda-torch-headers" / CUDA_TORCH.replace("==", "-")


def _cuda_torch_include() -> Path:
    """torch/include of the CUDA wheel, unpacked once under build/ (the wheel itself is not
    kept)."""
    include = HEADERS_CACHE / "torch" / "include"
    if include.is_dir():
        return include
    HEADERS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as wheels,
        tempfile.TemporaryDirectory(dir=HEADERS_CACHE.parent) as part,
    ):
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", wheels, CUDA_TORCH],
            check=False,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if fetched.returncode != 0:
            pytest.skip(
                f"pip could not fetch {CUDA_TORCH} for its CUDA headers: {fetched.stderr[-500:]}"
            )
        (wheel,) = Path(wheels).glob("torch-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(
                part, [n for n in archive.namelist() if n.startswith("torch/include/")]
            )
        # Renamed whole, so an interrupted unpack is never taken for the headers.
        Path(part).rename(HEADERS_CACHE)
    return include


@needs_nvcc
@pytest.mark.parametrize("binding", BINDINGS, ids=_rel)
def test_torch_binding_compiles_against_cuda_torch(binding: Path, tmp_path: Path) -> None:
    # The flags torch's cpp_extension gives a CUDA build (C++20 since torch 2.14); torch's own
    # headers are system headers, so -Werror holds the bindings alone to -Wall.
    include = _cuda_torch_include()
    _host_compile(
        binding,
        tmp_path / "binding.o",
        "-std=c++20",
        "-isystem",
        str(include),
        "-isystem",
        str(include / "torch" / "csrc" / "api" / "include"),
        "-DKVCI_WITH_CUDA=1",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=_C",
    )


def test_every_kernel_has_a_checked_binding() -> None:
    assert {p.name for p in BINDINGS} == {"pages_binding.cpp", "prefix_keys_binding.cpp"}
