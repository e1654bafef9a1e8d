#!/usr/bin/env bash
# The GPU check of the CUDA kernels, one run on a CUDA machine, about 3-5 minutes (8 at most):
# builds kvci_plugin._C with CUDA and the per-page memcpy baseline, runs tests/gpu and the
# worker's copy tests with the KV cache on the GPU, then
# benchmarks page transfers and prefix keys (benchmarks/gpu/bench_gpu.py), then runs the kernel
# tests under compute-sanitizer's memcheck in the time left.
#
# Uses the machine's python3 and its torch as they are (no venv, nothing downloaded). Writes
# gpu_run.log, gpu_tests.xml and gpu_bench.json to $OUT when it is set, else to
# benchmarks/results/. Every stage runs whatever the one before said; exits with the first
# failing status of the tests (memcheck errors count as 97), then of the benchmark.
set -euo pipefail
cd "$(dirname "$0")/../.."
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir" build/gpu_bench
exec > >(tee "$out_dir/gpu_run.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! command -v nvcc >/dev/null; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi
# torch looks for the toolkit beside the nvcc on the PATH, which may be a wrapper script
# elsewhere (then cuda_runtime.h is not found): ask nvcc where it really lives.
command -v nvcc >/dev/null || { echo "nvcc not found (nor in /usr/local/cuda/bin)"; exit 1; }
if [ -z "${CUDA_HOME:-}" ]; then
    nvcc_bin="$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1)"
    if [ -n "$nvcc_bin" ]; then
        export CUDA_HOME="$(dirname "$nvcc_bin")"
    fi
fi

echo "== versions"
uname -m
python3 --version
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
nvcc --version | tail -n 2
echo "CUDA_HOME=${CUDA_HOME:-(torch decides)}"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv || echo "nvidia-smi: no answer"
echo "cpus: $(nproc)"
# What the tests import beyond torch (no vLLM, no pydantic there): fail here, by name, if missing.
python3 -c 'import hypothesis, numpy, pytest, safetensors, xxhash'

echo "== build"
start=$SECONDS
KVCI_CUDA=1 MAX_JOBS="$(nproc)" python3 setup.py -q build_ext --inplace
nvcc -O2 -std=c++17 -shared -Xcompiler -fPIC -cudart shared \
    -o build/gpu_bench/libkvci_memcpy_each.so benchmarks/gpu/memcpy_each.cu
python3 -c 'import torch, kvci_plugin.ops
has = torch._C._dispatch_has_kernel_for_dispatch_key
print("CUDA kernels registered:", {n: has("kvci::" + n, "CUDA") for n in
      ("gather_pages", "scatter_pages", "prefix_block_keys", "prefix_block_keys_batched")})'
echo "built in $((SECONDS - start)) s"

echo "== tests/gpu and the worker tests (no vLLM there: the worker side imports torch alone)"
start=$SECONDS
set +e
timeout 240 python3 -m pytest tests/gpu tests/connector/test_worker_copies.py \
    tests/connector/test_worker_disk_load.py -q -p no:cacheprovider \
    --junitxml "$out_dir/gpu_tests.xml"
tests_status=$?
set -e
echo "tests: exit $tests_status in $((SECONDS - start)) s"

echo "== benchmark"
start=$SECONDS
set +e
timeout 200 python3 benchmarks/gpu/bench_gpu.py \
    --memcpy-each-lib build/gpu_bench/libkvci_memcpy_each.so --json "$out_dir/gpu_bench.json"
bench_status=$?
set -e
echo "benchmark: exit $bench_status in $((SECONDS - start)) s"

# The kernels under compute-sanitizer's memcheck, in what is left of the 8 minutes: an access
# out of bounds can leave the bytes the tests compare intact. Not every runtime supports it
# (gVisor refuses the device); only errors it reports fail the run.
left=$((480 - SECONDS))
if command -v compute-sanitizer >/dev/null && [ "$left" -gt 60 ]; then
    echo "== memcheck (${left} s at most)"
    set +e
    # Without torch's caching allocator every tensor is its own allocation, so a write past
    # one is out of bounds for memcheck instead of landing in a neighbour.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$left" \
        compute-sanitizer --tool memcheck --error-exitcode 97 --target-processes all \
        python3 -m pytest tests/gpu/test_pages_cuda.py tests/gpu/test_prefix_keys_cuda.py -q -x \
        -p no:cacheprovider
    memcheck_status=$?
    set -e
    case "$memcheck_status" in
        0) echo "memcheck: clean" ;;
        97) echo "memcheck: errors reported (above)"
            if [ "$tests_status" -eq 0 ]; then tests_status=97; fi ;;
        *) echo "memcheck: did not complete here (exit $memcheck_status)" ;;
    esac
fi
if [ "$tests_status" -ne 0 ]; then
    exit "$tests_status"
fi
exit "$bench_status"
