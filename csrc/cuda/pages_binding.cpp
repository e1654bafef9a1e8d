// CUDA kernels of kvci::gather_pages and kvci::scatter_pages (schemas in cpu/registration.cpp).
//
// The dispatcher picks them when any argument is a CUDA tensor: the layers live on one GPU, the
// pool in pinned host memory (or on that GPU), block_ids and slot_ids on the CPU, where they are
// checked before the launch. The copy runs asynchronously on the current CUDA stream: put it on a
// side stream and order it against the forward pass with events.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/pages.h"

namespace kvci {
namespace {

void check_byte_matrix(const at::Tensor& t, const char* op, const std::string& name,
                       bool allow_int8) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte || (allow_int8 && t.scalar_type() == at::kChar),
                   op, ": ", name, " must be ", allow_int8 ? "uint8 or int8" : "uint8",
                   ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", name, " must be 2-D (rows, bytes), got shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.size(1) > 0, op, ": ", name, " has empty rows");
  TORCH_CHECK_VALUE(t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) >= t.size(1)), op, ": ",
                    name, " rows must be dense and must not overlap, got strides ",
                    t.strides());
}

// Layer views as kernel table entries, all on one CUDA device.
std::vector<KvciPageLayer> layer_table(at::TensorList layers, const char* op,
                                       int64_t& num_blocks, int64_t& slot_bytes) {
  TORCH_CHECK_VALUE(!layers.empty(), op, ": layers must not be empty");
  const c10::Device device = layers[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), op, ": layers must be on a CUDA device, got ", device);
  std::vector<KvciPageLayer> table;
  num_blocks = layers[0].dim() > 0 ? layers[0].size(0) : 0;
  slot_bytes = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor& layer = layers[l];
    const std::string name = "layers[" + std::to_string(l) + "]";
    TORCH_CHECK_VALUE(layer.device() == device, op, ": ", name, " is on ", layer.device(),
                      " but layers[0] is on ", device);
    check_byte_matrix(layer, op, name, true);
    table.push_back({static_cast<uint8_t*>(layer.data_ptr()), layer.stride(0), layer.size(1),
                     slot_bytes});
    slot_bytes += layer.size(1);
    num_blocks = std::min(num_blocks, layer.size(0));
  }
  return table;
}

// Index tensor as int64 values, each in [0, bound); `unique` also refuses repeats, for the side
// that is written (two pages copied into one destination would race).
at::Tensor checked_ids(const at::Tensor& ids, int64_t bound, bool unique, const char* op,
                       const char* name, const char* bound_name) {
  TORCH_CHECK_VALUE(ids.device().is_cpu(), op, ": ", name,
                    " must be on the CPU (ids are checked there before the launch), got device ",
                    ids.device());
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, op, ": ",
                   name, " must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 1, op, ": ", name, " must be 1-D, got shape ", ids.sizes());
  const at::Tensor values = ids.to(at::kLong).contiguous();
  const int64_t* v = values.data_ptr<int64_t>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    TORCH_CHECK_INDEX(v[i] >= 0 && v[i] < bound, op, ": ", name, "[", i, "] = ", v[i],
                      " is out of range for ", bound_name, " ", bound);
  }
  if (unique && values.numel() > 1) {
    std::vector<int64_t> sorted(v, v + values.numel());
    std::sort(sorted.begin(), sorted.end());
    const auto repeat = std::adjacent_find(sorted.begin(), sorted.end());
    TORCH_CHECK_VALUE(repeat == sorted.end(), op, ": ", name, " repeats ", *repeat,
                      ": each destination may be written once");
  }
  return values;
}

// The address at which the kernels on `device` reach the pool.
uint8_t* pool_address(const at::Tensor& pool, c10::Device device, const char* op) {
  if (pool.device().is_cuda()) {
    TORCH_CHECK_VALUE(pool.device() == device, op, ": pool is on ", pool.device(),
                      " but the layers are on ", device);
    return static_cast<uint8_t*>(pool.data_ptr());
  }
  TORCH_CHECK_VALUE(pool.device().is_cpu(), op, ": pool must be in pinned host memory or on ",
                    device, ", got device ", pool.device());
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, pool.data_ptr());
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // an unknown pointer is an argument error, not a CUDA fault
  }
  TORCH_CHECK_VALUE(status == cudaSuccess && attributes.type == cudaMemoryTypeHost &&
                        attributes.devicePointer != nullptr,
                    op, ": pool is in pageable host memory: the GPU copies need it pinned "
                    "(Tensor.pin_memory()) or on ", device);
  return static_cast<uint8_t*>(attributes.devicePointer);
}

void copy_pages(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& pool,
                const at::Tensor& slot_ids, KvciPageDirection direction, const char* op) {
  int64_t num_blocks = 0;
  int64_t slot_bytes = 0;
  const std::vector<KvciPageLayer> table = layer_table(layers, op, num_blocks, slot_bytes);
  const c10::Device device = layers[0].device();
  check_byte_matrix(pool, op, "pool", false);
  TORCH_CHECK_VALUE(pool.size(1) >= slot_bytes, op, ": pool slots hold ", pool.size(1),
                    " bytes but one block of every layer needs ", slot_bytes);
  const bool to_pool = direction == KVCI_PAGES_TO_POOL;
  const at::Tensor blocks =
      checked_ids(block_ids, num_blocks, !to_pool, op, "block_ids", "layers with num_blocks");
  const at::Tensor slots =
      checked_ids(slot_ids, pool.size(0), to_pool, op, "slot_ids", "pool with num_slots");
  const int64_t n = blocks.numel();
  TORCH_CHECK_VALUE(n == slots.numel(), op, ": block_ids and slot_ids differ in length: ", n,
                    " vs ", slots.numel());
  if (n == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  uint8_t* pool_base = pool_address(pool, device, op);
  // The layer table and both id arrays travel to the device in one pinned copy, ordered on the
  // stream before the kernel (torch keeps the pinned buffer alive until the copy has run).
  const int64_t table_bytes = int64_t(table.size() * sizeof(KvciPageLayer));
  const int64_t ids_bytes = n * int64_t(sizeof(int64_t));
  const at::Tensor staged = at::empty({table_bytes + 2 * ids_bytes},
                                      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* host = staged.data_ptr<uint8_t>();
  std::memcpy(host, table.data(), size_t(table_bytes));
  std::memcpy(host + table_bytes, blocks.data_ptr<int64_t>(), size_t(ids_bytes));
  std::memcpy(host + table_bytes + ids_bytes, slots.data_ptr<int64_t>(), size_t(ids_bytes));
  at::Tensor on_device =
      at::empty({staged.numel()}, at::TensorOptions().dtype(at::kByte).device(device));
  on_device.copy_(staged, /*non_blocking=*/true);
  const uint8_t* dev = on_device.data_ptr<uint8_t>();
  const auto* dev_table = reinterpret_cast<const KvciPageLayer*>(dev);
  const auto* dev_blocks = reinterpret_cast<const int64_t*>(dev + table_bytes);
  const auto* dev_slots = reinterpret_cast<const int64_t*>(dev + table_bytes + ids_bytes);
  C10_CUDA_CHECK(kvci_copy_pages(table.data(), dev_table, int32_t(table.size()), dev_blocks,
                                 dev_slots, n, pool_base, pool.stride(0), direction,
                                 c10::cuda::getCurrentCUDAStream(device.index()).stream()));
}

// A CUDA copy is one launch whatever ``threads`` says (it bounds the CPU's copy threads); a bad
// value is refused alike on both.
void check_threads(int64_t threads, const char* op) {
  TORCH_CHECK_VALUE(threads >= 0, op, ": threads must be >= 0 (0: chosen by size), got ", threads);
}

void gather_pages(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& pool,
                  const at::Tensor& slot_ids, int64_t threads) {
  check_threads(threads, "kvci::gather_pages");
  copy_pages(layers, block_ids, pool, slot_ids, KVCI_PAGES_TO_POOL, "kvci::gather_pages");
}

void scatter_pages(const at::Tensor& pool, const at::Tensor& slot_ids, at::TensorList layers,
                   const at::Tensor& block_ids, int64_t threads) {
  check_threads(threads, "kvci::scatter_pages");
  copy_pages(layers, block_ids, pool, slot_ids, KVCI_PAGES_FROM_POOL, "kvci::scatter_pages");
}

}  // namespace
}  // namespace kvci

TORCH_LIBRARY_IMPL(kvci, CUDA, m) {
  m.impl("gather_pages", &kvci::gather_pages);
  m.impl("scatter_pages", &kvci::scatter_pages);
}
