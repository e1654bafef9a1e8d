// CPU kernels of kvci::prefix_block_keys and kvci::prefix_block_keys_batched.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "cpu/block_keys.h"

namespace kvci {
namespace {

constexpr int64_t kSubkeyBytes = 32;  // kb || kc, each a 16-byte SipHash key
constexpr int64_t kMaxTokenId = 0x7fffffff;

// A batch is spread over threads only from this many tokens per thread on.
constexpr int64_t kTokensPerThread = 65536;

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) {
    v = (v << 8) | p[i];
  }
  return v;
}

struct Subkeys {
  sip::Key block;
  sip::Key chain;
};

Subkeys read_subkeys(const uint8_t* p) {
  return {{read_le64(p), read_le64(p + 8)}, {read_le64(p + 16), read_le64(p + 24)}};
}

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got device ",
                    t.device());
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", name, " must be a dense tensor");
}

// Token ids as canonical uint32 values (read them with token_words): int32 data as it is, int64
// data narrowed into a new int32 tensor. Every id must lie in [0, 2^31): the key format hashes
// ids as 4-byte words, and a silently truncated id would alias another prompt.
at::Tensor canonical_tokens(const at::Tensor& tokens, const char* op) {
  const int64_t n = tokens.numel();
  uint64_t out_of_range = 0;
  at::Tensor canonical = tokens;
  if (tokens.scalar_type() == at::kInt) {
    const int32_t* src = tokens.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      out_of_range |= uint32_t(src[i]) >> 31;
    }
  } else {
    canonical = at::empty({n}, at::TensorOptions().dtype(at::kInt));
    const int64_t* src = tokens.data_ptr<int64_t>();
    int32_t* dst = canonical.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      out_of_range |= uint64_t(src[i]) >> 31;
      dst[i] = int32_t(uint32_t(src[i]));
    }
  }
  if (out_of_range != 0) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = tokens.scalar_type() == at::kInt ? tokens.data_ptr<int32_t>()[i]
                                                          : tokens.data_ptr<int64_t>()[i];
      TORCH_CHECK_VALUE(id >= 0 && id <= kMaxTokenId, op, ": token_ids[", i, "] = ", id,
                        " is outside the token id range [0, ", kMaxTokenId,
                        "] of the key format");
    }
  }
  return canonical;
}

const uint32_t* token_words(const at::Tensor& canonical) {
  return reinterpret_cast<const uint32_t*>(canonical.data_ptr<int32_t>());
}

void check_tokens(const at::Tensor& tokens, const char* op) {
  check_cpu(tokens, op, "token_ids");
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong, op,
                   ": token_ids must be int32 or int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.dim() == 1, op, ": token_ids must be 1-D, got shape ",
                    tokens.sizes());
}

void check_subkeys(const at::Tensor& subkeys, int64_t rows, const char* op) {
  check_cpu(subkeys, op, "subkeys");
  TORCH_CHECK_TYPE(subkeys.scalar_type() == at::kByte, op, ": subkeys must be uint8, got ",
                   subkeys.scalar_type());
  TORCH_CHECK_VALUE(subkeys.numel() == rows * kSubkeyBytes, op, ": subkeys must hold ",
                    kSubkeyBytes, " bytes per request (", rows, " requests), got shape ",
                    subkeys.sizes());
}

// Keys every request r (tokens [token_off[r], token_off[r + 1])) into out rows
// [block_off[r], block_off[r + 1]). Each request is keyed on one thread: its chain is sequential,
// and one prompt's keys take tens of microseconds, less than waking other threads may cost.
// Large batches are spread over threads in contiguous runs of requests of about equal size.
void key_requests(const uint32_t* tokens, const int64_t* token_off, const int64_t* block_off,
                  int64_t n_requests, int64_t block_size, const uint8_t* subkey_bytes,
                  uint64_t* out) {
  const int64_t n_blocks = block_off[n_requests];
  const at::Tensor scratch = at::empty({6, n_blocks}, at::TensorOptions().dtype(at::kUInt64));
  uint64_t* base = scratch.data_ptr<uint64_t>();
  const auto key_request = [&](int64_t r) {
    const int64_t b = block_off[r];
    const keys::ChainBuffers buf{base + b,
                                 base + n_blocks + b,
                                 base + 2 * n_blocks + b,
                                 base + 3 * n_blocks + b,
                                 base + 4 * n_blocks + b,
                                 base + 5 * n_blocks + b};
    const Subkeys subkeys = read_subkeys(subkey_bytes + r * kSubkeyBytes);
    keys::prefix_keys(tokens + token_off[r], block_off[r + 1] - b, block_size, subkeys.block,
                      subkeys.chain, buf, out + 2 * b);
  };
  const int64_t total = token_off[n_requests];
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>({total / kTokensPerThread, at::get_num_threads(), n_requests}));
  // Part p keys the requests that start in tokens [p * total / parts, (p + 1) * total / parts).
  const auto first_request = [&](int64_t p) {
    if (p == parts) {
      return n_requests;
    }
    return int64_t(std::lower_bound(token_off, token_off + n_requests, p * total / parts) -
                   token_off);
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = first_request(begin); r < first_request(end); ++r) {
      key_request(r);
    }
  });
}

at::Tensor prefix_block_keys(const at::Tensor& token_ids, int64_t block_size,
                             const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  check_tokens(token_ids, op);
  check_subkeys(subkeys, 1, op);
  const at::Tensor tokens = token_ids.contiguous();
  const at::Tensor key_bytes = subkeys.contiguous();
  const at::Tensor canonical = canonical_tokens(tokens, op);
  const int64_t token_off[2] = {0, tokens.numel()};
  const int64_t block_off[2] = {0, tokens.numel() / block_size};
  at::Tensor keys = at::empty({block_off[1], 2}, at::TensorOptions().dtype(at::kUInt64));
  key_requests(token_words(canonical), token_off, block_off, 1, block_size,
               key_bytes.data_ptr<uint8_t>(), keys.data_ptr<uint64_t>());
  return keys;
}

std::tuple<at::Tensor, at::Tensor> prefix_block_keys_batched(const at::Tensor& token_ids,
                                                             const at::Tensor& token_offsets,
                                                             int64_t block_size,
                                                             const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys_batched";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  check_tokens(token_ids, op);
  check_cpu(token_offsets, op, "token_offsets");
  TORCH_CHECK_TYPE(token_offsets.scalar_type() == at::kLong, op,
                   ": token_offsets must be int64, got ", token_offsets.scalar_type());
  TORCH_CHECK_VALUE(token_offsets.dim() == 1 && token_offsets.numel() >= 1, op,
                    ": token_offsets must be 1-D with one entry more than there are requests, "
                    "got shape ",
                    token_offsets.sizes());
  const int64_t n_requests = token_offsets.numel() - 1;
  check_subkeys(subkeys, n_requests, op);
  const at::Tensor tokens = token_ids.contiguous();
  const at::Tensor offsets = token_offsets.contiguous();
  const at::Tensor key_bytes = subkeys.contiguous();
  const int64_t* token_off = offsets.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(token_off[0] == 0 && token_off[n_requests] == tokens.numel(), op,
                    ": token_offsets must start at 0 and end at len(token_ids) = ",
                    tokens.numel(), ", got ", token_off[0], " and ", token_off[n_requests]);
  at::Tensor block_offsets = at::empty({n_requests + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* block_off = block_offsets.data_ptr<int64_t>();
  block_off[0] = 0;
  for (int64_t r = 0; r < n_requests; ++r) {
    TORCH_CHECK_VALUE(token_off[r] <= token_off[r + 1], op,
                      ": token_offsets must be non-decreasing, got ", token_off[r], " then ",
                      token_off[r + 1], " at request ", r);
    block_off[r + 1] = block_off[r] + (token_off[r + 1] - token_off[r]) / block_size;
  }
  const at::Tensor canonical = canonical_tokens(tokens, op);
  at::Tensor keys =
      at::empty({block_off[n_requests], 2}, at::TensorOptions().dtype(at::kUInt64));
  key_requests(token_words(canonical), token_off, block_off, n_requests, block_size,
               key_bytes.data_ptr<uint8_t>(), keys.data_ptr<uint64_t>());
  return {keys, block_offsets};
}

}  // namespace
}  // namespace kvci

TORCH_LIBRARY_IMPL(kvci, CPU, m) {
  m.impl("prefix_block_keys", &kvci::prefix_block_keys);
  m.impl("prefix_block_keys_batched", &kvci::prefix_block_keys_batched);
}
