// SipHash-2-4 with 128-bit output, written from the specification (Aumasson & Bernstein,
// "SipHash: a fast short-input PRF", 2012, and its reference code's 128-bit mode).
// Torch-free and host/device-neutral so a CUDA kernel can share it bit for bit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVCI_HD __host__ __device__ __forceinline__
#else
#define KVCI_HD inline
#endif

namespace kvci::sip {

struct Key {
  uint64_t k0;
  uint64_t k1;
};

// A little-endian 64-bit word, whatever the host's order.
KVCI_HD uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) {
    v = (v << 8) | p[i];
  }
  return v;
}

// A key from its 16 bytes, LE64(k0) || LE64(k1): the form kvci's subkeys travel in.
KVCI_HD Key read_key(const uint8_t* p) {
  return {read_le64(p), read_le64(p + 8)};
}

struct State {
  uint64_t v0, v1, v2, v3;
};

KVCI_HD uint64_t rotl(uint64_t x, int b) {
  return (x << b) | (x >> (64 - b));
}

KVCI_HD void sip_round(State& s) {
  s.v0 += s.v1;
  s.v1 = rotl(s.v1, 13);
  s.v1 ^= s.v0;
  s.v0 = rotl(s.v0, 32);
  s.v2 += s.v3;
  s.v3 = rotl(s.v3, 16);
  s.v3 ^= s.v2;
  s.v0 += s.v3;
  s.v3 = rotl(s.v3, 21);
  s.v3 ^= s.v0;
  s.v2 += s.v1;
  s.v1 = rotl(s.v1, 17);
  s.v1 ^= s.v2;
  s.v2 = rotl(s.v2, 32);
}

// Initial state for the 128-bit output mode (the 0xee tweak of v1).
KVCI_HD State init128(const Key& k) {
  State s;
  s.v0 = 0x736f6d6570736575ULL ^ k.k0;
  s.v1 = 0x646f72616e646f6dULL ^ k.k1 ^ 0xeeULL;
  s.v2 = 0x6c7967656e657261ULL ^ k.k0;
  s.v3 = 0x7465646279746573ULL ^ k.k1;
  return s;
}

// One message word: c = 2 compression rounds.
KVCI_HD void absorb(State& s, uint64_t m) {
  s.v3 ^= m;
  sip_round(s);
  sip_round(s);
  s.v0 ^= m;
}

// The last word `b` carries the message length mod 256 in its top byte and the 0..7 trailing
// message bytes below it; then d = 4 rounds per 64-bit half of the 128-bit output.
KVCI_HD void finish128(State s, uint64_t b, uint64_t& out0, uint64_t& out1) {
  absorb(s, b);
  s.v2 ^= 0xeeULL;
  sip_round(s);
  sip_round(s);
  sip_round(s);
  sip_round(s);
  out0 = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
  s.v1 ^= 0xddULL;
  sip_round(s);
  sip_round(s);
  sip_round(s);
  sip_round(s);
  out1 = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
}

// Length word for a message of `len_bytes` bytes with no trailing partial word.
KVCI_HD uint64_t length_word(uint64_t len_bytes) {
  return len_bytes << 56;
}

}  // namespace kvci::sip
