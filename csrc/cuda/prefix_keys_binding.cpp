// CUDA kernels of kvci::prefix_block_keys and kvci::prefix_block_keys_batched (schemas in
// cpu/registration.cpp), bit-identical to the CPU ones.
//
// The dispatcher picks them when any argument is a CUDA tensor: the token ids live on one GPU,
// subkeys on the CPU or that GPU, and the keys come back on that GPU. A batch is keyed in one
// pass over all its requests. The call waits for its stream once, to refuse an invalid token id
// with the CPU op's error.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/prefix_keys.h"

namespace kvci {
namespace {

constexpr int64_t kSubkeyBytes = 32;  // kb || kc, each a 16-byte SipHash key
constexpr int64_t kMaxTokenId = 0x7fffffff;

c10::Device cuda_device_of(const at::Tensor& tokens, const char* op, const std::string& name) {
  TORCH_CHECK_VALUE(tokens.device().is_cuda(), op, ": ", name,
                    " must be on a CUDA device when another argument is, got device ",
                    tokens.device());
  return tokens.device();
}

void check_tokens(const at::Tensor& tokens, c10::Device device, const char* op,
                  const std::string& name) {
  TORCH_CHECK_VALUE(tokens.device() == device, op, ": ", name, " must be on ", device,
                    ", got device ", tokens.device());
  TORCH_CHECK_VALUE(tokens.layout() == at::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong, op,
                   ": ", name, " must be int32 or int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.dim() == 1, op, ": ", name, " must be 1-D, got shape ",
                    tokens.sizes());
}

// subkeys (kb || kc per request) checked, on `device`.
at::Tensor device_subkeys(const at::Tensor& subkeys, int64_t requests, c10::Device device,
                          const char* op) {
  TORCH_CHECK_VALUE(subkeys.device().is_cpu() || subkeys.device() == device, op,
                    ": subkeys must be on the CPU or on ", device, ", got device ",
                    subkeys.device());
  TORCH_CHECK_VALUE(subkeys.layout() == at::kStrided, op, ": subkeys must be a dense tensor");
  TORCH_CHECK_TYPE(subkeys.scalar_type() == at::kByte, op, ": subkeys must be uint8, got ",
                   subkeys.scalar_type());
  TORCH_CHECK_VALUE(subkeys.numel() == requests * kSubkeyBytes, op, ": subkeys must hold ",
                    kSubkeyBytes, " bytes per request (", requests, " requests), got shape ",
                    subkeys.sizes());
  return subkeys.contiguous().to(device);
}

struct KeyedBatch {
  at::Tensor keys;                 // uint64 [n_blocks, 2] on the GPU, request after request
  std::vector<int64_t> block_off;  // request r's keys are rows [block_off[r], block_off[r + 1])
  int64_t first_bad;               // index of the first id outside the key format, or -1
};

// Keys of the requests laid end to end in `tokens` (contiguous, on the current GPU): request r
// owns tokens [token_off[r], token_off[r + 1]) and subkeys row r.
KeyedBatch key_batch(const at::Tensor& tokens, const std::vector<int64_t>& token_off,
                     int64_t block_size, const at::Tensor& key_bytes) {
  const c10::Device device = tokens.device();
  const int64_t n_requests = int64_t(token_off.size()) - 1;
  std::vector<int64_t> block_off(token_off.size(), 0);
  for (int64_t r = 0; r < n_requests; ++r) {
    block_off[r + 1] = block_off[r] + (token_off[r + 1] - token_off[r]) / block_size;
  }
  const int64_t n_blocks = block_off.back();
  const int64_t n_offsets = n_requests + 1;
  const at::Tensor offsets_host =
      at::empty({2 * n_offsets}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* staged = offsets_host.data_ptr<int64_t>();
  std::memcpy(staged, token_off.data(), size_t(n_offsets) * sizeof(int64_t));
  std::memcpy(staged + n_offsets, block_off.data(), size_t(n_offsets) * sizeof(int64_t));
  const auto on_device = at::TensorOptions().device(device);
  at::Tensor offsets = at::empty({2 * n_offsets}, on_device.dtype(at::kLong));
  offsets.copy_(offsets_host, /*non_blocking=*/true);
  const at::Tensor scratch =
      at::empty({KVCI_KEY_SCRATCH_WORDS_PER_BLOCK * n_blocks}, on_device.dtype(at::kUInt64));
  at::Tensor keys = at::empty({n_blocks, 2}, on_device.dtype(at::kUInt64));
  // Read back as int64: all bits set (-1) means every id is valid.
  const at::Tensor first_bad = at::empty({1}, on_device.dtype(at::kLong));
  const int64_t* offsets_ptr = offsets.data_ptr<int64_t>();
  C10_CUDA_CHECK(kvci_prefix_keys(
      tokens.data_ptr(), int32_t(tokens.element_size()), tokens.numel(), offsets_ptr,
      offsets_ptr + n_offsets, n_requests, n_blocks, block_size, key_bytes.data_ptr<uint8_t>(),
      static_cast<uint64_t*>(scratch.data_ptr()), static_cast<uint64_t*>(keys.data_ptr()),
      static_cast<uint64_t*>(first_bad.data_ptr()),
      c10::cuda::getCurrentCUDAStream(device.index()).stream()));
  return {keys, std::move(block_off), first_bad.item<int64_t>()};
}

// Throws the CPU op's error for token id `name` = `id`.
void refuse_token(const char* op, const std::string& name, int64_t id) {
  TORCH_CHECK_VALUE(false, op, ": ", name, " = ", id, " is outside the token id range [0, ",
                    kMaxTokenId, "] of the key format");
}

at::Tensor prefix_block_keys(const at::Tensor& token_ids, int64_t block_size,
                             const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  const c10::Device device = cuda_device_of(token_ids, op, "token_ids");
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor key_bytes = device_subkeys(subkeys, 1, device, op);
  check_tokens(token_ids, device, op, "token_ids");
  const at::Tensor tokens = token_ids.contiguous();
  const KeyedBatch batch = key_batch(tokens, {0, tokens.numel()}, block_size, key_bytes);
  if (batch.first_bad >= 0) {
    refuse_token(op, "token_ids[" + std::to_string(batch.first_bad) + "]",
                 tokens[batch.first_bad].item<int64_t>());
  }
  return batch.keys;
}

std::vector<at::Tensor> prefix_block_keys_batched(at::TensorList token_ids, int64_t block_size,
                                                  const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys_batched";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  const int64_t n_requests = int64_t(token_ids.size());
  // With no requests, subkeys is the argument that brought the call here.
  const c10::Device device =
      n_requests > 0 ? cuda_device_of(token_ids[0], op, "token_ids[0]") : subkeys.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor key_bytes = device_subkeys(subkeys, n_requests, device, op);
  std::vector<int64_t> token_off{0};
  bool any_int64 = false;
  for (int64_t r = 0; r < n_requests; ++r) {
    check_tokens(token_ids[r], device, op, "token_ids[" + std::to_string(r) + "]");
    token_off.push_back(token_off.back() + token_ids[r].numel());
    any_int64 |= token_ids[r].scalar_type() == at::kLong;
  }
  if (n_requests == 0) {
    return {};
  }
  // The requests end to end, for one pass over the batch; int32 ids are widened when any
  // request is int64 (narrowing would hide an id outside the key format).
  std::vector<at::Tensor> parts;
  for (const at::Tensor& request : token_ids) {
    parts.push_back(any_int64 ? request.to(at::kLong) : request);
  }
  const at::Tensor tokens = at::cat(parts);
  const KeyedBatch batch = key_batch(tokens, token_off, block_size, key_bytes);
  if (batch.first_bad >= 0) {
    const int64_t r =
        std::upper_bound(token_off.begin(), token_off.end(), batch.first_bad) -
        token_off.begin() - 1;
    refuse_token(op,
                 "token_ids[" + std::to_string(r) + "][" +
                     std::to_string(batch.first_bad - token_off[r]) + "]",
                 tokens[batch.first_bad].item<int64_t>());
  }
  std::vector<at::Tensor> keys;
  for (int64_t r = 0; r < n_requests; ++r) {
    keys.push_back(batch.keys.narrow(0, batch.block_off[r],
                                     batch.block_off[r + 1] - batch.block_off[r]));
  }
  return keys;
}

}  // namespace
}  // namespace kvci

TORCH_LIBRARY_IMPL(kvci, CUDA, m) {
  m.impl("prefix_block_keys", &kvci::prefix_block_keys);
  m.impl("prefix_block_keys_batched", &kvci::prefix_block_keys_batched);
}
