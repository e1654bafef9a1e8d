// kvci-key-v1 prefix keys for a ragged batch of requests on the GPU. Plain CUDA: see
// prefix_keys.h. The work is split as in the CPU op (cpu/block_keys.h says why): block digests
// are independent (one thread each), each request's chain is sequential but only absorbs two
// words per block (one thread per request), and every key's finalisation depends on its own
// chain state only (one thread each).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cpu/siphash.h"
#include "cuda/prefix_keys.h"

namespace {

namespace sip = kvci::sip;

constexpr int kThreads = 256;
constexpr int64_t kMaxCtas = int64_t(1) << 16;  // grid-stride loops cover the rest
constexpr int64_t kSubkeyBytes = 32;
constexpr uint64_t kMaxTokenId = 0x7fffffff;

int ctas_for(int64_t n) {
  return int(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxCtas));
}

__device__ __forceinline__ int64_t first_index() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t index_stride() {
  return int64_t(gridDim.x) * blockDim.x;
}

// The request r that owns global block g: block_offsets[r] <= g < block_offsets[r + 1].
__device__ __forceinline__ int64_t request_of(const int64_t* __restrict__ block_offsets,
                                              int64_t n_requests, int64_t g) {
  int64_t lo = 0;  // block_offsets[lo] <= g
  int64_t hi = n_requests;  // block_offsets[hi] > g
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (block_offsets[mid] <= g) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Ids are hashed as 4-byte words: one outside [0, 2^31) would alias another prompt.
template <typename Token>
__global__ void find_bad_token(const Token* __restrict__ tokens, int64_t n_tokens,
                               unsigned long long* first_bad) {
  for (int64_t i = first_index(); i < n_tokens; i += index_stride()) {
    if (uint64_t(int64_t(tokens[i])) > kMaxTokenId) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

// d_g = SipHash-2-4-128(kb, LE32 tokens of block g) into (d0[g], d1[g]).
template <typename Token>
__global__ void block_digests(const Token* __restrict__ tokens,
                              const int64_t* __restrict__ token_offsets,
                              const int64_t* __restrict__ block_offsets, int64_t n_requests,
                              int64_t n_blocks, int64_t block_size,
                              const uint8_t* __restrict__ subkeys, uint64_t* __restrict__ d0,
                              uint64_t* __restrict__ d1) {
  for (int64_t g = first_index(); g < n_blocks; g += index_stride()) {
    const int64_t r = request_of(block_offsets, n_requests, g);
    const Token* block = tokens + token_offsets[r] + (g - block_offsets[r]) * block_size;
    sip::State s = sip::init128(sip::read_key(subkeys + r * kSubkeyBytes));
    for (int64_t i = 0; i + 1 < block_size; i += 2) {
      sip::absorb(s, uint64_t(uint32_t(block[i])) | (uint64_t(uint32_t(block[i + 1])) << 32));
    }
    uint64_t tail = sip::length_word(uint64_t(block_size) * 4);
    if (block_size & 1) {
      tail |= uint32_t(block[block_size - 1]);
    }
    sip::finish128(s, tail, d0[g], d1[g]);
  }
}

// Request r's chain state after absorbing d_0..d_j, for each of its blocks j.
__global__ void chain_states(const int64_t* __restrict__ block_offsets, int64_t n_requests,
                             const uint8_t* __restrict__ subkeys,
                             const uint64_t* __restrict__ d0, const uint64_t* __restrict__ d1,
                             uint64_t* __restrict__ s0, uint64_t* __restrict__ s1,
                             uint64_t* __restrict__ s2, uint64_t* __restrict__ s3) {
  for (int64_t r = first_index(); r < n_requests; r += index_stride()) {
    sip::State s = sip::init128(sip::read_key(subkeys + r * kSubkeyBytes + 16));
    const int64_t end = block_offsets[r + 1];
    int64_t g = block_offsets[r];
    // The next digest is loaded while this one is absorbed: the chain is latency-bound.
    uint64_t m0 = g < end ? d0[g] : 0;
    uint64_t m1 = g < end ? d1[g] : 0;
    for (; g < end; ++g) {
      const uint64_t next0 = g + 1 < end ? d0[g + 1] : 0;
      const uint64_t next1 = g + 1 < end ? d1[g + 1] : 0;
      sip::absorb(s, m0);
      sip::absorb(s, m1);
      s0[g] = s.v0;
      s1[g] = s.v1;
      s2[g] = s.v2;
      s3[g] = s.v3;
      m0 = next0;
      m1 = next1;
    }
  }
}

// key_g = finalisation of its chain state with the length of d_0..d_j (j = g's index in its
// request): 16 (j + 1) bytes, no partial word.
__global__ void finalize_keys(const int64_t* __restrict__ block_offsets, int64_t n_requests,
                              int64_t n_blocks, const uint64_t* __restrict__ s0,
                              const uint64_t* __restrict__ s1, const uint64_t* __restrict__ s2,
                              const uint64_t* __restrict__ s3, uint64_t* __restrict__ keys) {
  for (int64_t g = first_index(); g < n_blocks; g += index_stride()) {
    const int64_t j = g - block_offsets[request_of(block_offsets, n_requests, g)];
    const sip::State s{s0[g], s1[g], s2[g], s3[g]};
    sip::finish128(s, sip::length_word(uint64_t(j + 1) * 16), keys[2 * g], keys[2 * g + 1]);
  }
}

template <typename Token>
cudaError_t key_batch(const Token* tokens, int64_t n_tokens, const int64_t* token_offsets,
                      const int64_t* block_offsets, int64_t n_requests, int64_t n_blocks,
                      int64_t block_size, const uint8_t* subkeys, uint64_t* scratch,
                      uint64_t* keys, uint64_t* first_bad_token, cudaStream_t stream) {
  if (n_tokens > 0) {
    find_bad_token<Token><<<ctas_for(n_tokens), kThreads, 0, stream>>>(
        tokens, n_tokens, reinterpret_cast<unsigned long long*>(first_bad_token));
  }
  if (n_blocks > 0) {
    uint64_t* d0 = scratch;
    uint64_t* d1 = scratch + n_blocks;
    uint64_t* s0 = scratch + 2 * n_blocks;
    uint64_t* s1 = scratch + 3 * n_blocks;
    uint64_t* s2 = scratch + 4 * n_blocks;
    uint64_t* s3 = scratch + 5 * n_blocks;
    block_digests<Token><<<ctas_for(n_blocks), kThreads, 0, stream>>>(
        tokens, token_offsets, block_offsets, n_requests, n_blocks, block_size, subkeys, d0, d1);
    chain_states<<<ctas_for(n_requests), kThreads, 0, stream>>>(block_offsets, n_requests,
                                                                 subkeys, d0, d1, s0, s1, s2, s3);
    finalize_keys<<<ctas_for(n_blocks), kThreads, 0, stream>>>(block_offsets, n_requests,
                                                                n_blocks, s0, s1, s2, s3, keys);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t kvci_prefix_keys(const void* tokens, int32_t token_bytes,
                                        int64_t n_tokens, const int64_t* token_offsets,
                                        const int64_t* block_offsets, int64_t n_requests,
                                        int64_t n_blocks, int64_t block_size,
                                        const uint8_t* subkeys, uint64_t* scratch,
                                        uint64_t* keys, uint64_t* first_bad_token,
                                        cudaStream_t stream) {
  if ((token_bytes != 4 && token_bytes != 8) || n_tokens < 0 || n_requests < 0 ||
      n_blocks < 0 || block_size <= 0) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t status =
      cudaMemsetAsync(first_bad_token, 0xff, sizeof(uint64_t), stream);
  if (status != cudaSuccess) {
    return status;
  }
  if (token_bytes == 4) {
    return key_batch(static_cast<const int32_t*>(tokens), n_tokens, token_offsets,
                     block_offsets, n_requests, n_blocks, block_size, subkeys, scratch, keys,
                     first_bad_token, stream);
  }
  return key_batch(static_cast<const int64_t*>(tokens), n_tokens, token_offsets, block_offsets,
                   n_requests, n_blocks, block_size, subkeys, scratch, keys, first_bad_token,
                   stream);
}
