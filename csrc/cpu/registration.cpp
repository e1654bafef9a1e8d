// The kvci operator schemas (torch.ops.kvci.*). Device kernels register themselves per dispatch
// key next to their code.
#include <torch/library.h>

TORCH_LIBRARY(kvci, m) {
  // Keys of the full blocks of token_ids; subkeys = kb || kc (32 bytes). Returns uint64 [n, 2].
  m.def("prefix_block_keys(Tensor token_ids, int block_size, Tensor subkeys) -> Tensor");
  // Many requests at once: request r is token_ids[r], keyed with subkeys[32 r : 32 r + 32].
  m.def(
      "prefix_block_keys_batched(Tensor[] token_ids, int block_size, Tensor subkeys) -> "
      "Tensor[]");
  // pool[slot_ids[i], off_l : off_l + page_bytes_l] = layers[l][block_ids[i]] for every layer l.
  // threads: on the CPU, at most this many copy threads, the caller's included; 0: as many as
  // the copy's size and the host's cores make worth it. A CUDA copy is one kernel launch.
  m.def(
      "gather_pages(Tensor[] layers, Tensor block_ids, Tensor(a!) pool, Tensor slot_ids, "
      "int threads=0) -> ()");
  // The reverse copy: layers[l][block_ids[i]] = pool[slot_ids[i], off_l : off_l + page_bytes_l].
  m.def(
      "scatter_pages(Tensor pool, Tensor slot_ids, Tensor(a!)[] layers, Tensor block_ids, "
      "int threads=0) -> ()");
}
