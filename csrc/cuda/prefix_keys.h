// C API of the CUDA prefix keys behind kvci::prefix_block_keys(_batched) on CUDA.
//
// Torch-free (raw pointers, sizes and a stream); prefix_keys_binding.cpp checks the torch
// arguments and calls it. The keys are kvci-key-v1 (cpu/block_keys.h states the construction),
// bit-identical to the CPU op: both use the same SipHash code (cpu/siphash.h).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Scratch words per block: digest (2) and chain state (4).
enum { KVCI_KEY_SCRATCH_WORDS_PER_BLOCK = 6 };

// Keys the full blocks of a ragged batch, asynchronously on `stream`. Request r owns tokens
// [token_offsets[r], token_offsets[r + 1]), its keys go to rows [block_offsets[r],
// block_offsets[r + 1]) of `keys` (n_blocks rows of [out0, out1]), keyed by subkeys[32 r ..]
// (kb || kc, each two little-endian 64-bit words).
//
// tokens holds n_tokens ids of token_bytes (4 or 8) bytes each. Every id must lie in
// [0, 2^31): *first_bad_token receives the smallest index of an id that does not, or
// UINT64_MAX when all do; keys are meaningless unless it is UINT64_MAX.
// All pointers are device memory; scratch holds KVCI_KEY_SCRATCH_WORDS_PER_BLOCK * n_blocks
// words. block_offsets[r + 1] - block_offsets[r] must be
// (token_offsets[r + 1] - token_offsets[r]) / block_size (the caller computes both).
cudaError_t kvci_prefix_keys(const void* tokens, int32_t token_bytes, int64_t n_tokens,
                             const int64_t* token_offsets, const int64_t* block_offsets,
                             int64_t n_requests, int64_t n_blocks, int64_t block_size,
                             const uint8_t* subkeys, uint64_t* scratch, uint64_t* keys,
                             uint64_t* first_bad_token, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif
