#include "cpu/block_keys.h"

// KVCI_PORTABLE builds the scalar code alone (it gives the same keys; the tests compare them).
#if defined(__x86_64__) && !defined(KVCI_PORTABLE)
#include <immintrin.h>
#define KVCI_HAVE_X86_LANES 1
#endif

namespace kvci::keys {
namespace {

// Two consecutive tokens as one little-endian 64-bit message word, independent of host order.
inline uint64_t token_word(const uint32_t* t, int64_t i) {
  return uint64_t(t[i]) | (uint64_t(t[i + 1]) << 32);
}

// A block's last SipHash word: its byte length, plus its final token when bs is odd.
inline uint64_t block_tail_word(const uint32_t* block, int64_t bs) {
  uint64_t b = sip::length_word(uint64_t(bs) * 4);
  if (bs & 1) {
    b |= block[bs - 1];
  }
  return b;
}

// The digest string d_0..d_j is 16 (j + 1) bytes long: it has no trailing partial word.
inline uint64_t chain_tail_word(int64_t j) {
  return sip::length_word(uint64_t(j + 1) * 16);
}

// The sequential part: absorbs block digests into the running chain state, one block per
// step(), recording the state after each block. The SIMD kernels call step() between their own
// rounds, so this latency-bound scalar work runs on the integer units alongside them.
struct Chain {
  sip::State state;
  const ChainBuffers& buf;
  int64_t next = 0;   // first block not yet absorbed
  int64_t ready = 0;  // blocks whose digests are written

  void step() {
    if (next < ready) {
      sip::absorb(state, buf.d0[next]);
      sip::absorb(state, buf.d1[next]);
      buf.s0[next] = state.v0;
      buf.s1[next] = state.v1;
      buf.s2[next] = state.v2;
      buf.s3[next] = state.v3;
      ++next;
    }
  }
};

void digest_scalar(const uint32_t* tokens, int64_t bs, const sip::Key& kb, int64_t j,
                   const ChainBuffers& buf) {
  const uint32_t* block = tokens + j * bs;
  sip::State s = sip::init128(kb);
  for (int64_t i = 0; i + 1 < bs; i += 2) {
    sip::absorb(s, token_word(block, i));
  }
  sip::finish128(s, block_tail_word(block, bs), buf.d0[j], buf.d1[j]);
}

void finalize_scalar(int64_t j, const ChainBuffers& buf, uint64_t* out) {
  const sip::State s{buf.s0[j], buf.s1[j], buf.s2[j], buf.s3[j]};
  sip::finish128(s, chain_tail_word(j), out[2 * j], out[2 * j + 1]);
}

#if KVCI_HAVE_X86_LANES
// AVX2: four SipHash states per register, G registers in flight to hide latency. Selected at
// run time; the scalar code above computes the same values (it also serves every tail).
#define KVCI_AVX2 __attribute__((target("avx2")))
#define KVCI_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline

struct Lanes {
  __m256i v0, v1, v2, v3;
};

template <int B>
KVCI_AVX2_INLINE __m256i rotl(__m256i x) {
  return _mm256_or_si256(_mm256_slli_epi64(x, B), _mm256_srli_epi64(x, 64 - B));
}

KVCI_AVX2_INLINE __m256i rotl32(__m256i x) {
  return _mm256_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1));
}

KVCI_AVX2_INLINE __m256i rotl16(__m256i x) {
  const __m256i bytes = _mm256_setr_epi8(6, 7, 0, 1, 2, 3, 4, 5, 14, 15, 8, 9, 10, 11, 12, 13,
                                         6, 7, 0, 1, 2, 3, 4, 5, 14, 15, 8, 9, 10, 11, 12, 13);
  return _mm256_shuffle_epi8(x, bytes);
}

template <int G>
KVCI_AVX2_INLINE void round_lanes(Lanes (&s)[G]) {
  for (int g = 0; g < G; ++g) {
    s[g].v0 = _mm256_add_epi64(s[g].v0, s[g].v1);
    s[g].v2 = _mm256_add_epi64(s[g].v2, s[g].v3);
  }
  for (int g = 0; g < G; ++g) {
    s[g].v1 = _mm256_xor_si256(rotl<13>(s[g].v1), s[g].v0);
    s[g].v3 = _mm256_xor_si256(rotl16(s[g].v3), s[g].v2);
    s[g].v0 = rotl32(s[g].v0);
  }
  for (int g = 0; g < G; ++g) {
    s[g].v0 = _mm256_add_epi64(s[g].v0, s[g].v3);
    s[g].v2 = _mm256_add_epi64(s[g].v2, s[g].v1);
  }
  for (int g = 0; g < G; ++g) {
    s[g].v3 = _mm256_xor_si256(rotl<21>(s[g].v3), s[g].v0);
    s[g].v1 = _mm256_xor_si256(rotl<17>(s[g].v1), s[g].v2);
    s[g].v2 = rotl32(s[g].v2);
  }
}

template <int G>
KVCI_AVX2_INLINE void absorb_lanes(Lanes (&s)[G], const __m256i (&m)[G]) {
  for (int g = 0; g < G; ++g) {
    s[g].v3 = _mm256_xor_si256(s[g].v3, m[g]);
  }
  round_lanes(s);
  round_lanes(s);
  for (int g = 0; g < G; ++g) {
    s[g].v0 = _mm256_xor_si256(s[g].v0, m[g]);
  }
}

template <int G>
KVCI_AVX2_INLINE void finish_lanes(Lanes (&s)[G], const __m256i (&b)[G], __m256i (&out0)[G],
                                   __m256i (&out1)[G], Chain& chain) {
  absorb_lanes(s, b);
  chain.step();
  for (int g = 0; g < G; ++g) {
    s[g].v2 = _mm256_xor_si256(s[g].v2, _mm256_set1_epi64x(0xee));
  }
  for (int r = 0; r < 4; ++r) {
    round_lanes(s);
  }
  chain.step();
  for (int g = 0; g < G; ++g) {
    out0[g] = _mm256_xor_si256(_mm256_xor_si256(s[g].v0, s[g].v1),
                               _mm256_xor_si256(s[g].v2, s[g].v3));
    s[g].v1 = _mm256_xor_si256(s[g].v1, _mm256_set1_epi64x(0xdd));
  }
  for (int r = 0; r < 4; ++r) {
    round_lanes(s);
  }
  for (int g = 0; g < G; ++g) {
    out1[g] = _mm256_xor_si256(_mm256_xor_si256(s[g].v0, s[g].v1),
                               _mm256_xor_si256(s[g].v2, s[g].v3));
  }
}

// Blocks j .. j + 4G - 1, block j + 4g + l in lane l of register g.
template <int G>
KVCI_AVX2 void digest_lanes(const uint32_t* tokens, int64_t bs, const sip::Key& kb, int64_t j,
                            const ChainBuffers& buf, Chain& shared_chain) {
  Chain chain = shared_chain;  // a local copy stays in registers
  const sip::State init = sip::init128(kb);
  Lanes s[G];
  for (int g = 0; g < G; ++g) {
    s[g] = {_mm256_set1_epi64x(int64_t(init.v0)), _mm256_set1_epi64x(int64_t(init.v1)),
            _mm256_set1_epi64x(int64_t(init.v2)), _mm256_set1_epi64x(int64_t(init.v3))};
  }
  int64_t i = 0;
  // Eight tokens (four words) of each of the four blocks, transposed so that register k holds
  // word k of every lane.
  for (; i + 8 <= bs; i += 8) {
    __m256i w[4][G];
    for (int g = 0; g < G; ++g) {
      const uint32_t* at = tokens + (j + 4 * g) * bs + i;
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + bs));
      const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 2 * bs));
      const __m256i r3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 3 * bs));
      const __m256i even01 = _mm256_unpacklo_epi64(r0, r1);
      const __m256i odd01 = _mm256_unpackhi_epi64(r0, r1);
      const __m256i even23 = _mm256_unpacklo_epi64(r2, r3);
      const __m256i odd23 = _mm256_unpackhi_epi64(r2, r3);
      w[0][g] = _mm256_permute2x128_si256(even01, even23, 0x20);
      w[1][g] = _mm256_permute2x128_si256(odd01, odd23, 0x20);
      w[2][g] = _mm256_permute2x128_si256(even01, even23, 0x31);
      w[3][g] = _mm256_permute2x128_si256(odd01, odd23, 0x31);
    }
    for (int k = 0; k < 4; ++k) {
      absorb_lanes(s, w[k]);
      chain.step();
    }
  }
  // Remaining whole words, gathered (indices in tokens, scale 4 bytes).
  const __m256i lane_offsets = _mm256_setr_epi64x(0, bs, 2 * bs, 3 * bs);
  for (; i + 1 < bs; i += 2) {
    __m256i m[G];
    for (int g = 0; g < G; ++g) {
      const uint32_t* at = tokens + (j + 4 * g) * bs + i;
      m[g] = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(at), lane_offsets, 4);
    }
    absorb_lanes(s, m);
    chain.step();
  }
  __m256i b[G];
  for (int g = 0; g < G; ++g) {
    const uint32_t* first = tokens + (j + 4 * g) * bs;
    b[g] = _mm256_setr_epi64x(int64_t(block_tail_word(first, bs)),
                              int64_t(block_tail_word(first + bs, bs)),
                              int64_t(block_tail_word(first + 2 * bs, bs)),
                              int64_t(block_tail_word(first + 3 * bs, bs)));
  }
  __m256i out0[G];
  __m256i out1[G];
  finish_lanes(s, b, out0, out1, chain);
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.d0 + j + 4 * g), out0[g]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.d1 + j + 4 * g), out1[g]);
  }
  shared_chain.state = chain.state;
  shared_chain.next = chain.next;
}

// Keys j .. j + 4G - 1 from their recorded chain states, written as rows (out0, out1).
template <int G>
KVCI_AVX2 void finalize_lanes(int64_t j, const ChainBuffers& buf, uint64_t* out,
                              Chain& shared_chain) {
  Chain chain = shared_chain;  // a local copy stays in registers
  Lanes s[G];
  __m256i b[G];
  for (int g = 0; g < G; ++g) {
    const int64_t at = j + 4 * g;
    s[g] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.s0 + at)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.s1 + at)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.s2 + at)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(buf.s3 + at))};
    b[g] = _mm256_setr_epi64x(int64_t(chain_tail_word(at)), int64_t(chain_tail_word(at + 1)),
                              int64_t(chain_tail_word(at + 2)), int64_t(chain_tail_word(at + 3)));
  }
  __m256i out0[G];
  __m256i out1[G];
  finish_lanes(s, b, out0, out1, chain);
  for (int g = 0; g < G; ++g) {
    const __m256i lo = _mm256_unpacklo_epi64(out0[g], out1[g]);  // rows 0 and 2
    const __m256i hi = _mm256_unpackhi_epi64(out0[g], out1[g]);  // rows 1 and 3
    uint64_t* row = out + 2 * (j + 4 * g);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 4),
                        _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  shared_chain.state = chain.state;
  shared_chain.next = chain.next;
}

bool have_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif  // KVCI_HAVE_X86_LANES

}  // namespace

void prefix_keys(const uint32_t* tokens, int64_t n_blocks, int64_t block_size,
                 const sip::Key& kb, const sip::Key& kc, const ChainBuffers& buf,
                 uint64_t* out) {
  Chain chain{sip::init128(kc), buf};
  int64_t digested = 0;
  int64_t finalized = 0;
#if KVCI_HAVE_X86_LANES
  if (have_avx2()) {
    // Software pipeline: digest blocks [d, d + 8) while the chain absorbs the blocks digested
    // before them, then finalise the oldest eight blocks the chain has passed.
    for (; digested + 8 <= n_blocks; digested += 8) {
      chain.ready = digested;
      digest_lanes<2>(tokens, block_size, kb, digested, buf, chain);
      if (finalized + 8 <= chain.next) {
        finalize_lanes<2>(finalized, buf, out, chain);
        finalized += 8;
      }
    }
  }
#endif
  for (; digested < n_blocks; ++digested) {
    digest_scalar(tokens, block_size, kb, digested, buf);
  }
  chain.ready = n_blocks;
  while (chain.next < n_blocks) {
    chain.step();
  }
#if KVCI_HAVE_X86_LANES
  if (have_avx2()) {
    for (; finalized + 8 <= n_blocks; finalized += 8) {
      finalize_lanes<2>(finalized, buf, out, chain);
    }
    for (; finalized + 4 <= n_blocks; finalized += 4) {
      finalize_lanes<1>(finalized, buf, out, chain);
    }
  }
#endif
  for (; finalized < n_blocks; ++finalized) {
    finalize_scalar(finalized, buf, out);
  }
}

}  // namespace kvci::keys
