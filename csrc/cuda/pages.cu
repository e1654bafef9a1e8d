// Page copies between the per-layer KV cache views on a GPU and a pool (pinned host or device
// memory) in one launch for every page of every layer. Plain CUDA: see pages.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/pages.h"

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerCta = 8;
// Vectors each lane loads before it stores: several reads in flight per lane hide the latency
// of reading pinned host memory over PCIe.
constexpr int kUnroll = 4;
// A warp copies one chunk of one layer's page at a time: small enough that a few large pages
// still spread over many warps, large enough that the index arithmetic is noise.
constexpr int64_t kChunkBytes = 16384;

// Bytes of the widest access (at most 16) that divides every address, stride, size and offset.
int vector_bytes(const KvciPageLayer* layers, int32_t n_layers, const uint8_t* pool,
                 int64_t pool_row_stride) {
  uint64_t bits = reinterpret_cast<uintptr_t>(pool) | uint64_t(pool_row_stride) | 16;
  for (int32_t l = 0; l < n_layers; ++l) {
    bits |= reinterpret_cast<uintptr_t>(layers[l].base) | uint64_t(layers[l].row_stride) |
            uint64_t(layers[l].page_bytes) | uint64_t(layers[l].pool_offset);
  }
  return int(bits & (~bits + 1));
}

template <typename Vec>
__device__ __forceinline__ void copy_chunk(const uint8_t* __restrict__ from,
                                           uint8_t* __restrict__ to, int64_t n_vectors,
                                           int lane) {
  const Vec* src = reinterpret_cast<const Vec*>(from);
  Vec* dst = reinterpret_cast<Vec*>(to);
  for (int64_t first = lane; first < n_vectors; first += kWarp * kUnroll) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * kWarp < n_vectors) {
        v[u] = src[first + u * kWarp];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * kWarp < n_vectors) {
        dst[first + u * kWarp] = v[u];
      }
    }
  }
}

// Task t = ((page i * n_layers) + layer l) * chunks_per_page + chunk c: consecutive warps copy
// consecutive bytes of a slot, so writes to the pool stream in address order.
template <typename Vec, KvciPageDirection kDirection>
__global__ void __launch_bounds__(kWarp * kWarpsPerCta)
    copy_pages_kernel(const KvciPageLayer* __restrict__ layers, int32_t n_layers,
                      const int64_t* __restrict__ block_ids,
                      const int64_t* __restrict__ slot_ids, int64_t n_pages,
                      int64_t chunks_per_page, uint8_t* pool, int64_t pool_row_stride) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t n_warps = int64_t(gridDim.x) * kWarpsPerCta;
  const int64_t n_tasks = n_pages * n_layers * chunks_per_page;
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; t < n_tasks;
       t += n_warps) {
    const int64_t chunk = t % chunks_per_page;
    const int64_t pair = t / chunks_per_page;
    const KvciPageLayer layer = layers[pair % n_layers];
    const int64_t i = pair / n_layers;
    const int64_t begin = chunk * kChunkBytes;
    if (begin >= layer.page_bytes) {
      continue;  // a layer with smaller pages than the largest one
    }
    const int64_t n_vectors =
        (layer.page_bytes - begin < kChunkBytes ? layer.page_bytes - begin : kChunkBytes) /
        int64_t(sizeof(Vec));
    uint8_t* page = layer.base + block_ids[i] * layer.row_stride + begin;
    uint8_t* slot = pool + slot_ids[i] * pool_row_stride + layer.pool_offset + begin;
    if (kDirection == KVCI_PAGES_TO_POOL) {
      copy_chunk<Vec>(page, slot, n_vectors, lane);
    } else {
      copy_chunk<Vec>(slot, page, n_vectors, lane);
    }
  }
}

template <typename Vec>
cudaError_t launch(KvciPageDirection direction, int ctas, cudaStream_t stream,
                   const KvciPageLayer* layers, int32_t n_layers, const int64_t* block_ids,
                   const int64_t* slot_ids, int64_t n_pages, int64_t chunks_per_page,
                   uint8_t* pool, int64_t pool_row_stride) {
  const dim3 grid{unsigned(ctas)};
  const dim3 block{kWarp * kWarpsPerCta};
  if (direction == KVCI_PAGES_TO_POOL) {
    copy_pages_kernel<Vec, KVCI_PAGES_TO_POOL><<<grid, block, 0, stream>>>(
        layers, n_layers, block_ids, slot_ids, n_pages, chunks_per_page, pool, pool_row_stride);
  } else {
    copy_pages_kernel<Vec, KVCI_PAGES_FROM_POOL><<<grid, block, 0, stream>>>(
        layers, n_layers, block_ids, slot_ids, n_pages, chunks_per_page, pool, pool_row_stride);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t kvci_copy_pages(const KvciPageLayer* layers_host,
                                       const KvciPageLayer* layers_device, int32_t n_layers,
                                       const int64_t* block_ids, const int64_t* slot_ids,
                                       int64_t n_pages, uint8_t* pool, int64_t pool_row_stride,
                                       KvciPageDirection direction, cudaStream_t stream) {
  if (n_layers <= 0 || n_pages < 0 ||
      (direction != KVCI_PAGES_TO_POOL && direction != KVCI_PAGES_FROM_POOL)) {
    return cudaErrorInvalidValue;
  }
  if (n_pages == 0) {
    return cudaSuccess;
  }
  int64_t largest_page = 0;
  for (int32_t l = 0; l < n_layers; ++l) {
    largest_page = std::max(largest_page, layers_host[l].page_bytes);
  }
  const int64_t chunks_per_page = (largest_page + kChunkBytes - 1) / kChunkBytes;
  const int64_t n_tasks = n_pages * n_layers * chunks_per_page;
  // At most one CTA (8 warps) per multiprocessor: enough reads in flight to fill PCIe, and most
  // of every multiprocessor left to the forward pass that runs beside the copy.
  int device = 0;
  int multiprocessors = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  }
  if (status != cudaSuccess) {
    return status;
  }
  const int ctas = int(std::min<int64_t>((n_tasks + kWarpsPerCta - 1) / kWarpsPerCta,
                                         std::max(multiprocessors, 1)));
  const auto go = [&](auto vector) {
    using Vec = decltype(vector);
    return launch<Vec>(direction, ctas, stream, layers_device, n_layers, block_ids, slot_ids,
                       n_pages, chunks_per_page, pool, pool_row_stride);
  };
  switch (vector_bytes(layers_host, n_layers, pool, pool_row_stride)) {
    case 16:
      return go(uint4{});
    case 8:
      return go(uint2{});
    case 4:
      return go(uint32_t{});
    case 2:
      return go(uint16_t{});
    default:
      return go(uint8_t{});
  }
}
