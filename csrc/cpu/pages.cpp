// CPU kernels of kvci::gather_pages and kvci::scatter_pages: whole-page byte copies between the
// per-layer KV cache views and a host pool, one pool slot holding one block of every layer.
#include <ATen/core/Tensor.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace kvci {
namespace {

// Bytes each copy thread gets at least: below this a thread's start (~50 us) costs more than
// it saves. A copy is memory-bound, so a few threads reach the host's bandwidth. A layer of the
// TTFT benchmark's 4k-token hit (8 MiB) is copied on two.
constexpr int64_t kBytesPerThread = int64_t(2) << 20;
constexpr unsigned kMaxCopyThreads = 4;

template <typename Body>
struct Part {
  const Body* body;
  int64_t begin, end;
};

template <typename Body>
void* run_part(void* arg) {
  const auto* part = static_cast<const Part<Body>*>(arg);
  (*part->body)(part->begin, part->end);
  return nullptr;
}

// Runs body(begin, end) (which must not throw: it copies bytes) over [0, n) on up to
// kMaxCopyThreads threads, the caller's included.
// Not torch's intra-op pool: vLLM's CPU worker sizes and pins that pool to its compute cores,
// and a load runs while the forward waits for it and the scheduler's reserved core is idle. So
// the helper threads start on the cores this process's cpuset allows but the caller's (they
// start per copy, so nothing outlives a fork). Placed there at birth: a helper born on the
// caller's pinned core waits behind the caller's own copy until that core's next slice before it
// can move (measured: 0.6 ms of a 32 MiB copy's 1.3 ms, a pinned caller's two-thread copy
// taking 1.85 ms instead of 1.28).
// At most max_threads threads (0: no bound but those).
template <typename Body>
void parallel_pages(int64_t n, int64_t bytes_per_item, int64_t max_threads, const Body& body) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t by_size = std::max<int64_t>(1, n * bytes_per_item / kBytesPerThread);
  int64_t threads = std::min<int64_t>({by_size, int64_t(std::min(cores, kMaxCopyThreads)), n});
  if (max_threads > 0) threads = std::min(threads, max_threads);
  if (threads <= 1) {
    body(0, n);
    return;
  }
  const int caller_core = sched_getcpu();
  cpu_set_t others;
  CPU_ZERO(&others);
  for (unsigned c = 0; c < cores && c < CPU_SETSIZE; ++c) {
    if (int(c) != caller_core) CPU_SET(c, &others);
  }
  const int64_t per = (n + threads - 1) / threads;
  std::vector<Part<Body>> parts;
  parts.reserve(threads - 1);
  std::vector<pthread_t> helpers;
  int64_t started = 1;
  for (; started < threads; ++started) {
    parts.push_back({&body, started * per, std::min(n, (started + 1) * per)});
    pthread_attr_t attr;
    pthread_t helper;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
      pthread_attr_setaffinity_np(&attr, sizeof(others), &others);
      rc = pthread_create(&helper, &attr, run_part<Body>, &parts.back());
      pthread_attr_destroy(&attr);
    }
    // No other core this cpuset allows: the inherited mask (slower, not wrong).
    if (rc != 0) rc = pthread_create(&helper, nullptr, run_part<Body>, &parts.back());
    if (rc != 0) break;  // no thread to be had: the caller copies the rest
    helpers.push_back(helper);
  }
  body(0, std::min(n, per));
  if (started * per < n) body(started * per, n);
  for (pthread_t helper : helpers) pthread_join(helper, nullptr);
}

struct PageTable {
  std::vector<uint8_t*> base;        // layer l's first page
  std::vector<int64_t> row_stride;   // bytes between consecutive pages of layer l
  std::vector<int64_t> page_bytes;   // bytes of one page of layer l
  std::vector<int64_t> pool_offset;  // where layer l's page starts within a slot
  int64_t num_blocks = 0;            // fewest pages of any layer: the bound for block ids
  int64_t slot_bytes = 0;            // sum of page_bytes
};

void check_byte_matrix(const at::Tensor& t, const char* op, const std::string& name,
                       bool allow_int8) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got device ",
                    t.device());
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

PageTable page_table(at::TensorList layers, const char* op) {
  TORCH_CHECK_VALUE(!layers.empty(), op, ": layers must not be empty");
  PageTable table;
  table.num_blocks = layers[0].dim() > 0 ? layers[0].size(0) : 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor& layer = layers[l];
    check_byte_matrix(layer, op, "layers[" + std::to_string(l) + "]", true);
    table.base.push_back(static_cast<uint8_t*>(layer.data_ptr()));
    table.row_stride.push_back(layer.stride(0));
    table.page_bytes.push_back(layer.size(1));
    table.pool_offset.push_back(table.slot_bytes);
    table.slot_bytes += layer.size(1);
    table.num_blocks = std::min(table.num_blocks, layer.size(0));
  }
  return table;
}

// Index tensor as int64 values, each in [0, bound); `unique` also refuses repeats, for the side
// that is written (two pages copied into one destination would race).
at::Tensor checked_ids(const at::Tensor& ids, int64_t bound, bool unique, const char* op,
                       const char* name, const char* bound_name) {
  TORCH_CHECK_VALUE(ids.device().is_cpu(), op, ": ", name, " must be on the CPU, got device ",
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

enum class Direction { kToPool, kFromPool };

void copy_pages(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& pool,
                const at::Tensor& slot_ids, int64_t threads, Direction direction, const char* op) {
  TORCH_CHECK_VALUE(threads >= 0, op, ": threads must be >= 0 (0: chosen by size), got ", threads);
  const PageTable table = page_table(layers, op);
  check_byte_matrix(pool, op, "pool", false);
  TORCH_CHECK_VALUE(pool.size(1) >= table.slot_bytes, op, ": pool slots hold ", pool.size(1),
                    " bytes but one block of every layer needs ", table.slot_bytes);
  const bool to_pool = direction == Direction::kToPool;
  const at::Tensor blocks = checked_ids(block_ids, table.num_blocks, !to_pool, op, "block_ids",
                                        "layers with num_blocks");
  const at::Tensor slots =
      checked_ids(slot_ids, pool.size(0), to_pool, op, "slot_ids", "pool with num_slots");
  TORCH_CHECK_VALUE(blocks.numel() == slots.numel(), op, ": block_ids and slot_ids differ in "
                    "length: ", blocks.numel(), " vs ", slots.numel());
  const int64_t* block = blocks.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  uint8_t* pool_base = static_cast<uint8_t*>(pool.data_ptr());
  const int64_t pool_stride = pool.stride(0);
  const size_t n_layers = table.base.size();
  parallel_pages(blocks.numel(), table.slot_bytes, threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint8_t* slot_row = pool_base + slot[i] * pool_stride;
      for (size_t l = 0; l < n_layers; ++l) {
        uint8_t* page = table.base[l] + block[i] * table.row_stride[l];
        uint8_t* in_slot = slot_row + table.pool_offset[l];
        if (to_pool) {
          std::memcpy(in_slot, page, size_t(table.page_bytes[l]));
        } else {
          std::memcpy(page, in_slot, size_t(table.page_bytes[l]));
        }
      }
    }
  });
}

void gather_pages(at::TensorList layers, const at::Tensor& block_ids, const at::Tensor& pool,
                  const at::Tensor& slot_ids, int64_t threads) {
  copy_pages(layers, block_ids, pool, slot_ids, threads, Direction::kToPool, "kvci::gather_pages");
}

void scatter_pages(const at::Tensor& pool, const at::Tensor& slot_ids, at::TensorList layers,
                   const at::Tensor& block_ids, int64_t threads) {
  copy_pages(layers, block_ids, pool, slot_ids, threads, Direction::kFromPool, "kvci::scatter_pages");
}

}  // namespace
}  // namespace kvci

TORCH_LIBRARY_IMPL(kvci, CPU, m) {
  m.impl("gather_pages", &kvci::gather_pages);
  m.impl("scatter_pages", &kvci::scatter_pages);
}
