// CPU kernels of kvci::prefix_block_keys and kvci::prefix_block_keys_batched.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/block_keys.h"

namespace kvci {
namespace {

constexpr int64_t kSubkeyBytes = 32;  // kb || kc, each a 16-byte SipHash key
constexpr int64_t kMaxTokenId = 0x7fffffff;

// A batch is spread over threads only from this many tokens per thread on: one prompt's keys
// take tens of microseconds, less than waking another thread may cost.
constexpr int64_t kTokensPerThread = 65536;

void check_cpu(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got device ",
                    t.device());
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", name, " must be a dense tensor");
}

void check_subkeys(const at::Tensor& subkeys, int64_t requests, const char* op) {
  check_cpu(subkeys, op, "subkeys");
  TORCH_CHECK_TYPE(subkeys.scalar_type() == at::kByte, op, ": subkeys must be uint8, got ",
                   subkeys.scalar_type());
  TORCH_CHECK_VALUE(subkeys.numel() == requests * kSubkeyBytes, op, ": subkeys must hold ",
                    kSubkeyBytes, " bytes per request (", requests, " requests), got shape ",
                    subkeys.sizes());
}

// Bitwise OR of src[0..n) (copying it narrowed to int32 into dst when given). Sixteen
// accumulators let the compiler vectorise without one serial dependency through a register.
template <typename T>
uint64_t or_of_all(const T* src, int64_t n, int32_t* dst) {
  using Bits = std::make_unsigned_t<T>;
  constexpr int kLanes = 16;
  Bits lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      lanes[k] |= Bits(src[i + k]);
      if (dst != nullptr) {
        dst[i + k] = int32_t(src[i + k]);
      }
    }
  }
  Bits bits = 0;
  for (; i < n; ++i) {
    bits |= Bits(src[i]);
    if (dst != nullptr) {
      dst[i] = int32_t(src[i]);
    }
  }
  for (int k = 0; k < kLanes; ++k) {
    bits |= lanes[k];
  }
  return bits;
}

// Token ids as canonical uint32 values, in a contiguous int32 tensor: int32 data as it is, int64
// data narrowed into a copy. Every id must lie in [0, 2^31): the key format hashes ids as 4-byte
// words, and a silently truncated id would alias another prompt.
at::Tensor canonical_tokens(const at::Tensor& token_ids, const char* op,
                            const std::string& name) {
  check_cpu(token_ids, op, name);
  TORCH_CHECK_TYPE(token_ids.scalar_type() == at::kInt || token_ids.scalar_type() == at::kLong,
                   op, ": ", name, " must be int32 or int64, got ", token_ids.scalar_type());
  TORCH_CHECK_VALUE(token_ids.dim() == 1, op, ": ", name, " must be 1-D, got shape ",
                    token_ids.sizes());
  const at::Tensor tokens = token_ids.contiguous();
  const int64_t n = tokens.numel();
  at::Tensor canonical = tokens;
  uint64_t bits = 0;
  if (tokens.scalar_type() == at::kInt) {
    bits = or_of_all(tokens.data_ptr<int32_t>(), n, nullptr);
  } else {
    canonical = at::empty({n}, at::TensorOptions().dtype(at::kInt));
    bits = or_of_all(tokens.data_ptr<int64_t>(), n, canonical.data_ptr<int32_t>());
  }
  // Any negative id or any id >= 2^31 sets a bit from 31 up.
  if ((bits >> 31) != 0) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = tokens.scalar_type() == at::kInt ? tokens.data_ptr<int32_t>()[i]
                                                          : tokens.data_ptr<int64_t>()[i];
      TORCH_CHECK_VALUE(id >= 0 && id <= kMaxTokenId, op, ": ", name, "[", i, "] = ", id,
                        " is outside the token id range [0, ", kMaxTokenId,
                        "] of the key format");
    }
  }
  return canonical;
}

struct Request {
  const uint32_t* tokens;
  int64_t n_blocks;
  const uint8_t* subkeys;  // kb || kc
  uint64_t* keys;          // [n_blocks, 2]
};

// Keys every request, each on one thread (its chain is sequential). Large batches are spread
// over threads in contiguous runs of requests holding about equal numbers of blocks.
void key_requests(const std::vector<Request>& requests, int64_t block_size) {
  const int64_t n_requests = int64_t(requests.size());
  std::vector<int64_t> first_block(requests.size() + 1, 0);
  for (int64_t r = 0; r < n_requests; ++r) {
    first_block[r + 1] = first_block[r] + requests[r].n_blocks;
  }
  const int64_t n_blocks = first_block.back();
  const at::Tensor scratch = at::empty({6, n_blocks}, at::TensorOptions().dtype(at::kUInt64));
  uint64_t* base = scratch.data_ptr<uint64_t>();
  const auto key_request = [&](int64_t r) {
    const Request& request = requests[r];
    const int64_t b = first_block[r];
    const keys::ChainBuffers buf{base + b,
                                 base + n_blocks + b,
                                 base + 2 * n_blocks + b,
                                 base + 3 * n_blocks + b,
                                 base + 4 * n_blocks + b,
                                 base + 5 * n_blocks + b};
    const uint8_t* k = request.subkeys;
    keys::prefix_keys(request.tokens, request.n_blocks, block_size,
                      sip::read_key(k), sip::read_key(k + 16),
                      buf, request.keys);
  };
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(
             {n_blocks * block_size / kTokensPerThread, at::get_num_threads(), n_requests}));
  // Part p keys the requests whose first block lies in [p * n_blocks / parts, next part's).
  const auto first_request = [&](int64_t p) {
    return int64_t(std::lower_bound(first_block.begin(), first_block.end() - 1,
                                    p * n_blocks / parts) -
                   first_block.begin());
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    const int64_t last = end == parts ? n_requests : first_request(end);
    for (int64_t r = first_request(begin); r < last; ++r) {
      key_request(r);
    }
  });
}

at::Tensor prefix_block_keys(const at::Tensor& token_ids, int64_t block_size,
                             const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  check_subkeys(subkeys, 1, op);
  const at::Tensor canonical = canonical_tokens(token_ids, op, "token_ids");
  const at::Tensor key_bytes = subkeys.contiguous();
  const int64_t n_blocks = canonical.numel() / block_size;
  at::Tensor keys = at::empty({n_blocks, 2}, at::TensorOptions().dtype(at::kUInt64));
  key_requests({{reinterpret_cast<const uint32_t*>(canonical.data_ptr<int32_t>()), n_blocks,
                 key_bytes.data_ptr<uint8_t>(), keys.data_ptr<uint64_t>()}},
               block_size);
  return keys;
}

std::vector<at::Tensor> prefix_block_keys_batched(at::TensorList token_ids, int64_t block_size,
                                                  const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys_batched";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  const int64_t n_requests = int64_t(token_ids.size());
  check_subkeys(subkeys, n_requests, op);
  const at::Tensor key_bytes = subkeys.contiguous();
  std::vector<at::Tensor> canonical;
  std::vector<at::Tensor> keys;
  std::vector<Request> requests;
  for (int64_t r = 0; r < n_requests; ++r) {
    canonical.push_back(
        canonical_tokens(token_ids[r], op, "token_ids[" + std::to_string(r) + "]"));
    const int64_t n_blocks = canonical.back().numel() / block_size;
    keys.push_back(at::empty({n_blocks, 2}, at::TensorOptions().dtype(at::kUInt64)));
    requests.push_back({reinterpret_cast<const uint32_t*>(canonical.back().data_ptr<int32_t>()),
                        n_blocks, key_bytes.data_ptr<uint8_t>() + r * kSubkeyBytes,
                        keys.back().data_ptr<uint64_t>()});
  }
  key_requests(requests, block_size);
  return keys;
}

}  // namespace
}  // namespace kvci

TORCH_LIBRARY_IMPL(kvci, CPU, m) {
  m.impl("prefix_block_keys", &kvci::prefix_block_keys);
  m.impl("prefix_block_keys_batched", &kvci::prefix_block_keys_batched);
}
