// The Python module kvci_plugin._C. Importing it loads this library, which registers the
// torch.ops.kvci operators; it also offers pack_token_ids, a fast path from a Python sequence of
// ints to the key format's canonical int32 token ids (Python-level conversion costs about
// 20 ns per id, more than keying them); prefix_key_bytes, a prompt's keys from such a sequence
// straight to the 16-byte keys the tiers use; read_files (read_files.cpp), which reads a
// batch of files without the GIL; the RAM tier's KeyTable (key_table.cpp), its per-page
// column kernels (page_columns.cpp) and the value policy's reuse hazard (resend.cpp).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/block_keys.h"
#include "gc_leaf.h"
#include "idle_cells.h"
#include "key_table.h"
#include "page_columns.h"
#include "read_files.h"
#include "resend.h"

namespace {

constexpr long long kMaxTokenId = 0x7fffffff;
constexpr Py_ssize_t kSubkeyBytes = 32;  // kb || kc, each a 16-byte SipHash key

// Each id of `sequence` as a native int32 into dst (resized to the sequence's length), after
// checking it lies in [0, 2^31). Errors call the ids `name`; false with a Python error set on
// failure. Holds the GIL: it reads Python objects.
bool pack_ids(PyObject* sequence, PyObject* name, std::vector<int32_t>& dst) {
  PyObject* items = PySequence_Fast(sequence, "token ids must be a sequence of int");
  if (items == nullptr) {
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  dst.resize(size_t(n));
  PyObject** item = PySequence_Fast_ITEMS(items);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    // Exact ints take the fast path; other integers (numpy's, say) go through __index__.
    PyObject* index = nullptr;
    if (!PyLong_Check(item[i])) {
      if (!PyIndex_Check(item[i])) {
        PyErr_Format(PyExc_TypeError, "%U[%zd] must be an int, not %.100s", name, i,
                     Py_TYPE(item[i])->tp_name);
        ok = false;
        break;
      }
      if (!PyTuple_Check(items)) {
        // __index__ may run code that changes a list: continue over an immutable copy.
        PyObject* frozen = PySequence_Tuple(items);
        if (frozen == nullptr) {
          ok = false;
          break;
        }
        Py_DECREF(items);
        items = frozen;
        item = PySequence_Fast_ITEMS(items);
      }
      index = PyNumber_Index(item[i]);
      if (index == nullptr) {
        ok = false;
        break;
      }
    }
    int overflow = 0;
    const long long id =
        PyLong_AsLongLongAndOverflow(index != nullptr ? index : item[i], &overflow);
    Py_XDECREF(index);
    if (overflow != 0 || id < 0 || id > kMaxTokenId) {
      PyObject* bad = item[i];
      Py_INCREF(bad);  // its repr may run code
      PyErr_Format(PyExc_ValueError,
                   "%U[%zd] = %R is outside the token id range [0, %lld] of the key format",
                   name, i, bad, kMaxTokenId);
      Py_DECREF(bad);
      ok = false;
      break;
    }
    dst[size_t(i)] = int32_t(id);
  }
  Py_DECREF(items);
  return ok;
}

// pack_token_ids(token_ids: Sequence[int], out: writable buffer of 4 * len(token_ids) bytes,
// name: str) writes each id as a native int32 after checking it lies in [0, 2^31); errors call
// the ids `name`.
PyObject* pack_token_ids(PyObject* /*module*/, PyObject* args) {
  PyObject* sequence = nullptr;
  PyObject* out = nullptr;
  PyObject* name = nullptr;
  if (!PyArg_ParseTuple(args, "OOU:pack_token_ids", &sequence, &out, &name)) {
    return nullptr;
  }
  std::vector<int32_t> ids;
  if (!pack_ids(sequence, name, ids)) {
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
    return nullptr;
  }
  const Py_ssize_t need = Py_ssize_t(sizeof(int32_t) * ids.size());
  if (view.len != need) {
    PyErr_Format(PyExc_ValueError, "out holds %zd bytes, token_ids needs %zd", view.len, need);
    PyBuffer_Release(&view);
    return nullptr;
  }
  std::copy(ids.begin(), ids.end(), static_cast<int32_t*>(view.buf));
  PyBuffer_Release(&view);
  Py_RETURN_NONE;
}

// prefix_key_bytes(token_ids: Sequence[int], block_size: int, subkeys: bytes (kb || kc),
// name: str) -> list[bytes]: the kvci-key-v1 key of each full block, each as its 16 bytes
// LE64(out0) || LE64(out1), the form kvci::prefix_block_keys's keys take in key_bytes. The
// scheduler keys every request's prompt: one call here, with no tensor made on the way.
PyObject* prefix_key_bytes(PyObject* /*module*/, PyObject* args) {
  PyObject* sequence = nullptr;
  Py_ssize_t block_size = 0;
  const char* subkeys = nullptr;
  Py_ssize_t subkeys_len = 0;
  PyObject* name = nullptr;
  if (!PyArg_ParseTuple(args, "Ony#U:prefix_key_bytes", &sequence, &block_size, &subkeys,
                        &subkeys_len, &name)) {
    return nullptr;
  }
  if (block_size <= 0) {
    return PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", block_size);
  }
  if (subkeys_len != kSubkeyBytes) {
    return PyErr_Format(PyExc_ValueError, "subkeys must hold %zd bytes, got %zd", kSubkeyBytes,
                        subkeys_len);
  }
  std::vector<int32_t> ids;
  if (!pack_ids(sequence, name, ids)) {
    return nullptr;
  }
  const int64_t n_blocks = int64_t(ids.size()) / block_size;
  std::vector<uint64_t> scratch(size_t(6 * n_blocks));
  std::vector<uint64_t> keys(size_t(2 * n_blocks));
  uint64_t* s = scratch.data();
  const kvci::keys::ChainBuffers buf{s, s + n_blocks, s + 2 * n_blocks,
                                     s + 3 * n_blocks, s + 4 * n_blocks, s + 5 * n_blocks};
  const auto* k = reinterpret_cast<const uint8_t*>(subkeys);
  kvci::keys::prefix_keys(reinterpret_cast<const uint32_t*>(ids.data()), n_blocks, block_size,
                          kvci::sip::read_key(k), kvci::sip::read_key(k + 16),
                          buf, keys.data());
  PyObject* out = PyList_New(Py_ssize_t(n_blocks));
  if (out == nullptr) {
    return nullptr;
  }
  for (int64_t b = 0; b < n_blocks; ++b) {
    char bytes[16];
    for (int w = 0; w < 2; ++w) {
      const uint64_t word = keys[size_t(2 * b + w)];
      for (int i = 0; i < 8; ++i) {
        bytes[8 * w + i] = char((word >> (8 * i)) & 0xff);
      }
    }
    PyObject* key = PyBytes_FromStringAndSize(bytes, 16);
    if (key == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, Py_ssize_t(b), key);
  }
  return out;
}

PyMethodDef methods[] = {
    {"pack_token_ids", pack_token_ids, METH_VARARGS,
     "pack_token_ids(token_ids, out, name): token ids as checked int32 into a writable buffer"},
    {"prefix_key_bytes", prefix_key_bytes, METH_VARARGS,
     "prefix_key_bytes(token_ids, block_size, subkeys, name): each full block's 16-byte key"},
    {"read_files", kvci_read_files, METH_VARARGS,
     "read_files(paths, out): file i into row i of a writable buffer; sizes, or -errno each"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

#define KVCI_CONCAT(a, b) a##b
#define KVCI_PYINIT(name) KVCI_CONCAT(PyInit_, name)
#define KVCI_STR2(x) #x
#define KVCI_STR(x) KVCI_STR2(x)

PyMODINIT_FUNC KVCI_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, KVCI_STR(TORCH_EXTENSION_NAME), nullptr, 0,
                               methods};
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && (!kvci_add_key_table(m) || !kvci_add_page_columns(m) ||
                       !kvci_add_resend(m) || !kvci_add_gc_leaf(m) ||
                       !kvci_add_idle_cells(m))) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
