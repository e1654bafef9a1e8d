// C API of the CUDA page copies behind kvci::gather_pages / kvci::scatter_pages on CUDA.
//
// Torch-free (raw pointers, sizes and a stream) so that the kernels compile with nvcc alone;
// pages_binding.cpp checks the torch arguments and calls it. A page is bytes: any dtype, any
// vLLM layout, as long as each layer is seen as an int8 view (num_blocks, page_bytes) whose rows
// are dense (FlashAttention NHD: K and V of a layer are two such views; FlashInfer HND and MLA:
// one view per layer).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One layer's page view and where its page sits in a pool slot.
typedef struct KvciPageLayer {
  uint8_t* base;        // device address of page 0
  int64_t row_stride;   // bytes from one page to the next (at least page_bytes)
  int64_t page_bytes;   // bytes of one page
  int64_t pool_offset;  // byte offset of this layer's page within a slot
} KvciPageLayer;

typedef enum KvciPageDirection {
  KVCI_PAGES_TO_POOL = 0,    // gather: cache pages -> pool slots
  KVCI_PAGES_FROM_POOL = 1,  // scatter: pool slots -> cache pages
} KvciPageDirection;

// For i < n_pages and every layer l: copies page block_ids[i] of layer l to or from
// pool + slot_ids[i] * pool_row_stride + layers[l].pool_offset, in one kernel launch on `stream`
// (asynchronous; the pool must not be touched until the stream has passed it).
//
// layers_host and layers_device hold the same n_layers entries: the launch reads the host copy
// to pick its vector width and work split, the kernel reads the device copy. block_ids and
// slot_ids are device arrays of n_pages valid indices, each destination named once (the caller
// checks them). `pool` is an address the device can use: device memory or pinned host memory
// (cudaHostGetDevicePointer). Copies move 16 bytes per access when every address, stride, size
// and offset is a multiple of 16, else the largest power of two that divides them all.
cudaError_t kvci_copy_pages(const KvciPageLayer* layers_host, const KvciPageLayer* layers_device,
                            int32_t n_layers, const int64_t* block_ids, const int64_t* slot_ids,
                            int64_t n_pages, uint8_t* pool, int64_t pool_row_stride,
                            KvciPageDirection direction, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif
