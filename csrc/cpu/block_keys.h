// The kvci-key-v1 prefix key construction on raw arrays (torch-free).
//
// Inputs: token ids as canonical uint32 values (each checked to lie in [0, 2^31) by the caller),
// a block size bs >= 1, and two SipHash keys derived from (secret, namespace, tenant):
// kb for block digests, kc for the chain.
//
//   d_j   = SipHash-2-4-128(kb, LE32(t[j*bs]) || ... || LE32(t[j*bs + bs - 1]))
//   key_i = SipHash-2-4-128(kc, d_0 || d_1 || ... || d_i)        (each d_j as 16 bytes)
//
// where a 128-bit SipHash output (out0, out1) is the 16 bytes LE64(out0) || LE64(out1).
//
// Why this shape: the block digests are independent, so they run in SIMD lanes. key_i is
// SipHash over the growing digest string, and SipHash is a streaming hash: the state after
// absorbing d_0..d_i is shared by every later key, so the only sequential work is absorbing
// two words (4 SipRounds) per block; each key's finalisation (length word + 8 rounds) depends
// on its own state only and runs in SIMD lanes again. A textbook chain
// key_i = PRF(key_{i-1} || d_i) costs 16 sequential rounds per block instead. Security is that
// of SipHash-2-4-128 as a PRF: distinct prefixes give distinct digest strings unless two
// 128-bit block digests collide, and both keys stay secret.
#pragma once

#include <cstdint>

#include "cpu/siphash.h"

namespace kvci::keys {

// Scratch of 6 * n_blocks words in structure-of-arrays form (SIMD lanes load contiguous words).
struct ChainBuffers {
  uint64_t* d0;  // block digests, low 64 bits
  uint64_t* d1;  // block digests, high 64 bits
  uint64_t* s0;  // chain state after absorbing d_0..d_j
  uint64_t* s1;
  uint64_t* s2;
  uint64_t* s3;
};

// Keys of the n_blocks full blocks of `tokens` into out (row-major [n_blocks, 2]), on the
// calling thread.
void prefix_keys(const uint32_t* tokens, int64_t n_blocks, int64_t block_size,
                 const sip::Key& kb, const sip::Key& kc, const ChainBuffers& buf,
                 uint64_t* out);

}  // namespace kvci::keys
