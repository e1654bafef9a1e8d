// The Python module kvci_plugin._C. Importing it loads this library, which registers the
// torch.ops.kvci operators; it also offers pack_token_ids, a fast path from a Python sequence of
// ints to the key format's canonical int32 token ids (Python-level conversion costs about
// 20 ns per id, more than keying them), and read_files (read_files.cpp), which reads a batch of
// files without the GIL.
#include <Python.h>

#include <cstdint>

#include "read_files.h"

namespace {

constexpr long long kMaxTokenId = 0x7fffffff;

// pack_token_ids(token_ids: Sequence[int], out: writable buffer of 4 * len(token_ids) bytes,
// name: str) writes each id as a native int32 after checking it lies in [0, 2^31); errors call
// the ids `name`. Holds the GIL: it reads Python objects.
PyObject* pack_token_ids(PyObject* /*module*/, PyObject* args) {
  PyObject* sequence = nullptr;
  PyObject* out = nullptr;
  PyObject* name = nullptr;
  if (!PyArg_ParseTuple(args, "OOU:pack_token_ids", &sequence, &out, &name)) {
    return nullptr;
  }
  PyObject* items = PySequence_Fast(sequence, "token ids must be a sequence of int");
  if (items == nullptr) {
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject** item = PySequence_Fast_ITEMS(items);
  Py_buffer view;
  if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
    Py_DECREF(items);
    return nullptr;
  }
  PyObject* result = Py_None;
  if (view.len != Py_ssize_t(sizeof(int32_t)) * n) {
    PyErr_Format(PyExc_ValueError, "out holds %zd bytes, token_ids needs %zd", view.len,
                 Py_ssize_t(sizeof(int32_t)) * n);
    result = nullptr;
  }
  int32_t* dst = static_cast<int32_t*>(view.buf);
  for (Py_ssize_t i = 0; result != nullptr && i < n; ++i) {
    // Exact ints take the fast path; other integers (numpy's, say) go through __index__.
    PyObject* index = nullptr;
    if (!PyLong_Check(item[i])) {
      if (!PyIndex_Check(item[i])) {
        PyErr_Format(PyExc_TypeError, "%U[%zd] must be an int, not %.100s", name, i,
                     Py_TYPE(item[i])->tp_name);
        result = nullptr;
        break;
      }
      if (!PyTuple_Check(items)) {
        // __index__ may run code that changes a list: continue over an immutable copy.
        PyObject* frozen = PySequence_Tuple(items);
        if (frozen == nullptr) {
          result = nullptr;
          break;
        }
        Py_DECREF(items);
        items = frozen;
        item = PySequence_Fast_ITEMS(items);
      }
      index = PyNumber_Index(item[i]);
      if (index == nullptr) {
        result = nullptr;
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
      result = nullptr;
      break;
    }
    dst[i] = int32_t(id);
  }
  PyBuffer_Release(&view);
  Py_DECREF(items);
  Py_XINCREF(result);
  return result;
}

PyMethodDef methods[] = {
    {"pack_token_ids", pack_token_ids, METH_VARARGS,
     "pack_token_ids(token_ids, out, name): token ids as checked int32 into a writable buffer"},
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
  return PyModule_Create(&module);
}
