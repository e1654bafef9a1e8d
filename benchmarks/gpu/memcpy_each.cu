// Baseline (b) of bench_gpu.py: one cudaMemcpyAsync per page of every layer, issued from a C++
// loop as vLLM's swap_blocks does, so that the baseline pays the driver's per-copy cost and not
// Python's. Built by run.sh into a small shared library that bench_gpu.py loads with ctypes.
#include <cuda_runtime.h>

#include <cstdint>

// Copies bytes[i] bytes from address src[i] to address dst[i] for i < n, on `stream`. Returns
// the first CUDA error (0 when none).
extern "C" int kvci_bench_memcpy_each(const uint64_t* dst, const uint64_t* src,
                                      const int64_t* bytes, int64_t n, void* stream) {
  for (int64_t i = 0; i < n; ++i) {
    const cudaError_t status =
        cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                        size_t(bytes[i]), cudaMemcpyDefault, static_cast<cudaStream_t>(stream));
    if (status != cudaSuccess) {
      return int(status);
    }
  }
  return 0;
}
