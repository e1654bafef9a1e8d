// idle_cells: every open idle period of the value policy's anchors, counted and its age summed
// per (class, age bucket) in one pass over the anchor table's columns
// (kvci_plugin/policy/reuse_hazard.py, idle_exposure, turns the sums into seconds per bucket).
//
// The periodic hazard refresh reads every anchor, tens of thousands at 10^6 pages, on vLLM's
// scheduler thread. As numpy expressions that was a dozen passes, each with its own temporary
// of the table's length (memory the kernel had to fault in anew every time); here it is one
// pass and two small arrays. The sums must be numpy's, bit for bit (the simulator's decisions
// are compared before and after): each cell adds its ages in row order, as np.bincount does.
//
//   idle_cells(groups, since, now, n_groups, buckets) -> (count, total)
//       groups: int64, each period's group in [0, n_groups); since: float64, when each began.
//       A period's age is max(0, now - since); its bucket the age's binary exponent, clipped
//       to [0, buckets) (the edges are 0 and powers of two). count: int64 bytes and total:
//       float64 bytes, n_groups x buckets each, row-major.
#define PY_SSIZE_T_CLEAN
#include "idle_cells.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

namespace {

bool typed_buffer(PyObject* obj, Py_buffer* view, const char* code, const char* name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
  const char* f = view->format;
  if (f != nullptr && (*f == '<' || *f == '=' || *f == '@')) ++f;
  const bool int64 = std::strcmp(code, "q") == 0;
  const bool ok = view->itemsize == 8 && f != nullptr &&
                  (std::strcmp(f, code) == 0 || (int64 && std::strcmp(f, "l") == 0));
  if (!ok) {
    PyBuffer_Release(view);
    PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %s buffer", name,
                 int64 ? "int64" : "float64");
  }
  return ok;
}

PyObject* idle_cells(PyObject*, PyObject* args) {
  PyObject *groups_obj, *since_obj;
  double now;
  Py_ssize_t n_groups, buckets;
  if (!PyArg_ParseTuple(args, "OOdnn", &groups_obj, &since_obj, &now, &n_groups, &buckets)) {
    return nullptr;
  }
  if (n_groups < 1 || buckets < 1) {
    PyErr_SetString(PyExc_ValueError, "n_groups and buckets must be >= 1");
    return nullptr;
  }
  Py_buffer groups, since;
  if (!typed_buffer(groups_obj, &groups, "q", "groups")) return nullptr;
  if (!typed_buffer(since_obj, &since, "d", "since")) {
    PyBuffer_Release(&groups);
    return nullptr;
  }
  PyObject* out = nullptr;
  const Py_ssize_t n = groups.len / 8;
  if (since.len / 8 != n) {
    PyErr_SetString(PyExc_ValueError, "groups and since must be as long");
  } else {
    const auto* g = static_cast<const int64_t*>(groups.buf);
    const auto* s = static_cast<const double*>(since.buf);
    std::vector<int64_t> count(size_t(n_groups * buckets), 0);
    std::vector<double> total(size_t(n_groups * buckets), 0.0);
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (g[i] < 0 || g[i] >= n_groups) {
        bad = i;
        break;
      }
      const double d = now - s[i];
      const double age = d > 0.0 ? d : 0.0;
      int e = 0;
      std::frexp(age, &e);
      const Py_ssize_t b = e < 0 ? 0 : (e >= buckets ? buckets - 1 : e);
      const size_t cell = size_t(g[i] * buckets + b);
      count[cell] += 1;
      total[cell] = total[cell] + age;
    }
    if (bad >= 0) {
      PyErr_Format(PyExc_ValueError, "groups[%zd] = %lld is outside [0, %zd)", bad,
                   static_cast<long long>(g[bad]), n_groups);
    } else {
      out = Py_BuildValue("(y#y#)", reinterpret_cast<const char*>(count.data()),
                          Py_ssize_t(count.size() * 8),
                          reinterpret_cast<const char*>(total.data()),
                          Py_ssize_t(total.size() * 8));
    }
  }
  PyBuffer_Release(&groups);
  PyBuffer_Release(&since);
  return out;
}

PyMethodDef methods[] = {
    {"idle_cells", idle_cells, METH_VARARGS,
     "idle_cells(groups, since, now, n_groups, buckets) -> (count, total): per group and "
     "bucket, the open idle periods and the sum of their ages"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool kvci_add_idle_cells(PyObject* module) {
  return PyModule_AddFunctions(module, methods) == 0;
}
