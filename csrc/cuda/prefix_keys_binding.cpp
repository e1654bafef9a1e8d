// CUDA kernels of kvci::prefix_block_keys and kvci::prefix_block_keys_batched (schemas in
// cpu/registration.cpp), bit-identical to the CPU ones.
//
// The dispatcher picks them when token_ids (or subkeys) is a CUDA tensor. token_ids lives on the
// GPU; token_offsets stays on the CPU, since the output is sized from it; subkeys may be on
// either. Keys come back on the GPU of token_ids, block_offsets on the CPU. The call waits for
// its stream once, to refuse an invalid token id with the CPU op's error.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

#include "cuda/prefix_keys.h"

namespace kvci {
namespace {

constexpr int64_t kSubkeyBytes = 32;  // kb || kc, each a 16-byte SipHash key
constexpr int64_t kMaxTokenId = 0x7fffffff;

void check_tokens(const at::Tensor& tokens, const char* op) {
  TORCH_CHECK_VALUE(tokens.device().is_cuda(), op,
                    ": token_ids must be on a CUDA device when another argument is, got device ",
                    tokens.device());
  TORCH_CHECK_VALUE(tokens.layout() == at::kStrided, op, ": token_ids must be a dense tensor");
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong, op,
                   ": token_ids must be int32 or int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.dim() == 1, op, ": token_ids must be 1-D, got shape ",
                    tokens.sizes());
}

at::Tensor device_subkeys(const at::Tensor& subkeys, int64_t rows, c10::Device device,
                          const char* op) {
  TORCH_CHECK_VALUE(subkeys.device().is_cpu() || subkeys.device() == device, op,
                    ": subkeys must be on the CPU or on ", device, ", got device ",
                    subkeys.device());
  TORCH_CHECK_VALUE(subkeys.layout() == at::kStrided, op, ": subkeys must be a dense tensor");
  TORCH_CHECK_TYPE(subkeys.scalar_type() == at::kByte, op, ": subkeys must be uint8, got ",
                   subkeys.scalar_type());
  TORCH_CHECK_VALUE(subkeys.numel() == rows * kSubkeyBytes, op, ": subkeys must hold ",
                    kSubkeyBytes, " bytes per request (", rows, " requests), got shape ",
                    subkeys.sizes());
  return subkeys.contiguous().to(device);
}

// Keys of request r's tokens [token_off[r], token_off[r + 1]) into rows
// [block_off[r], block_off[r + 1]) of a uint64 [n_blocks, 2] tensor on the tokens' device.
at::Tensor keys_on_device(const at::Tensor& token_ids, const int64_t* token_off,
                          const int64_t* block_off, int64_t n_requests, int64_t block_size,
                          const at::Tensor& subkeys, const char* op) {
  const c10::Device device = token_ids.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor tokens = token_ids.contiguous();
  const at::Tensor key_bytes = device_subkeys(subkeys, n_requests, device, op);
  const int64_t n_blocks = block_off[n_requests];
  const int64_t n_offsets = n_requests + 1;
  const at::Tensor offsets_host =
      at::empty({2 * n_offsets}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* staged = offsets_host.data_ptr<int64_t>();
  std::memcpy(staged, token_off, size_t(n_offsets) * sizeof(int64_t));
  std::memcpy(staged + n_offsets, block_off, size_t(n_offsets) * sizeof(int64_t));
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
  const int64_t bad = first_bad.item<int64_t>();
  if (bad >= 0) {
    TORCH_CHECK_VALUE(false, op, ": token_ids[", bad, "] = ", tokens[bad].item<int64_t>(),
                      " is outside the token id range [0, ", kMaxTokenId,
                      "] of the key format");
  }
  return keys;
}

at::Tensor prefix_block_keys(const at::Tensor& token_ids, int64_t block_size,
                             const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  check_tokens(token_ids, op);
  const int64_t token_off[2] = {0, token_ids.numel()};
  const int64_t block_off[2] = {0, token_ids.numel() / block_size};
  return keys_on_device(token_ids, token_off, block_off, 1, block_size, subkeys, op);
}

std::tuple<at::Tensor, at::Tensor> prefix_block_keys_batched(const at::Tensor& token_ids,
                                                             const at::Tensor& token_offsets,
                                                             int64_t block_size,
                                                             const at::Tensor& subkeys) {
  const char* op = "kvci::prefix_block_keys_batched";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be positive, got ", block_size);
  check_tokens(token_ids, op);
  TORCH_CHECK_VALUE(token_offsets.device().is_cpu(), op,
                    ": token_offsets must be on the CPU (the keys are sized from them), "
                    "got device ",
                    token_offsets.device());
  TORCH_CHECK_TYPE(token_offsets.scalar_type() == at::kLong, op,
                   ": token_offsets must be int64, got ", token_offsets.scalar_type());
  TORCH_CHECK_VALUE(token_offsets.dim() == 1 && token_offsets.numel() >= 1, op,
                    ": token_offsets must be 1-D with one entry more than there are requests, "
                    "got shape ",
                    token_offsets.sizes());
  const int64_t n_requests = token_offsets.numel() - 1;
  const at::Tensor offsets = token_offsets.contiguous();
  const int64_t* token_off = offsets.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(token_off[0] == 0 && token_off[n_requests] == token_ids.numel(), op,
                    ": token_offsets must start at 0 and end at len(token_ids) = ",
                    token_ids.numel(), ", got ", token_off[0], " and ", token_off[n_requests]);
  at::Tensor block_offsets = at::empty({n_requests + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* block_off = block_offsets.data_ptr<int64_t>();
  block_off[0] = 0;
  for (int64_t r = 0; r < n_requests; ++r) {
    TORCH_CHECK_VALUE(token_off[r] <= token_off[r + 1], op,
                      ": token_offsets must be non-decreasing, got ", token_off[r], " then ",
                      token_off[r + 1], " at request ", r);
    block_off[r + 1] = block_off[r] + (token_off[r + 1] - token_off[r]) / block_size;
  }
  at::Tensor keys =
      keys_on_device(token_ids, token_off, block_off, n_requests, block_size, subkeys, op);
  return {keys, block_offsets};
}

}  // namespace
}  // namespace kvci

TORCH_LIBRARY_IMPL(kvci, CUDA, m) {
  m.impl("prefix_block_keys", &kvci::prefix_block_keys);
  m.impl("prefix_block_keys_batched", &kvci::prefix_block_keys_batched);
}
