// resend_probabilities: the value policy's reuse hazard, for every head an eviction weighs in
// one call (kvci_plugin/policy/reuse_hazard.py, ReuseHazard.resend_probability, is the same
// computation for one context, and the reference this must equal bit for bit: the simulator's
// figures must not move because the engine weighs in C).
//
//   resend_probabilities(hazards, rows, ages, horizon, edges) -> list[float]
//       hazards: float64 (classes x buckets), C-contiguous; rows: ints, the class row of each
//       context; ages: floats, each context's idle age; edges: float64, the buckets' starts.
//       Per context: 1 - exp(-H), H the hazard integrated from its age to its age + horizon,
//       bucket by bucket in ascending order, as the Python loop adds it.
#define PY_SSIZE_T_CLEAN
#include "resend.h"

#include <cmath>
#include <cstring>
#include <vector>

// The sums must round as Python's do, one multiply and one add at a time: no fused
// multiply-add, whatever the target.
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

namespace {

bool float64_buffer(PyObject* obj, Py_buffer* view, const char* name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
  const char* f = view->format;
  if (f != nullptr && (*f == '<' || *f == '=' || *f == '@')) ++f;
  if (view->itemsize != 8 || f == nullptr || std::strcmp(f, "d") != 0) {
    PyBuffer_Release(view);
    PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous float64 buffer", name);
    return false;
  }
  return true;
}

// ReuseHazard.resend_probability for one context, operation for operation.
double resend(const double* hazards, const double* edges, Py_ssize_t buckets, double age,
              double horizon) {
  const double end = age + horizon;
  // bucket(age): max(0, bisect_right(EDGES, age) - 1)
  Py_ssize_t first = 0;
  while (first < buckets && !(age < edges[first])) ++first;
  first = first > 0 ? first - 1 : 0;
  double total = 0.0;
  for (Py_ssize_t j = first; j < buckets; ++j) {
    const double lo = edges[j];
    if (lo >= end) break;
    const double hi = j + 1 < buckets ? edges[j + 1] : end;
    const double upper = end < hi ? end : hi;  // min(hi, end)
    const double lower = age > lo ? age : lo;  // max(lo, age)
    const double step = hazards[j] * (upper - lower);
    total = total + step;
  }
  return 1.0 - std::exp(-total);
}

PyObject* resend_probabilities(PyObject*, PyObject* args) {
  PyObject *hazards_obj, *rows_obj, *ages_obj, *edges_obj;
  double horizon;
  if (!PyArg_ParseTuple(args, "OOOdO", &hazards_obj, &rows_obj, &ages_obj, &horizon,
                        &edges_obj)) {
    return nullptr;
  }
  // Rows and ages are sequences (an eviction weighs a dozen heads, then one at a time: arrays
  // would cost more to make than the integrals); the tables are buffers.
  PyObject* rows = PySequence_Fast(rows_obj, "rows must be a sequence of ints");
  if (rows == nullptr) return nullptr;
  PyObject* ages = PySequence_Fast(ages_obj, "ages must be a sequence of floats");
  if (ages == nullptr) {
    Py_DECREF(rows);
    return nullptr;
  }
  Py_buffer hazards, edges;
  bool have_hazards = false, have_edges = false;
  PyObject* out = nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(rows);
  if (!(have_hazards = float64_buffer(hazards_obj, &hazards, "hazards")) ||
      !(have_edges = float64_buffer(edges_obj, &edges, "edges"))) {
    // the error is set
  } else if (PySequence_Fast_GET_SIZE(ages) != n) {
    PyErr_SetString(PyExc_ValueError, "rows and ages must be as long");
  } else {
    const Py_ssize_t buckets = edges.len / 8;
    const Py_ssize_t classes = buckets > 0 ? hazards.len / 8 / buckets : 0;
    if (buckets == 0 || hazards.len != classes * buckets * 8) {
      PyErr_SetString(PyExc_ValueError, "hazards must hold one row of len(edges) per class");
    } else {
      const auto* h = static_cast<const double*>(hazards.buf);
      const auto* e = static_cast<const double*>(edges.buf);
      PyObject** r = PySequence_Fast_ITEMS(rows);
      PyObject** a = PySequence_Fast_ITEMS(ages);
      out = PyList_New(n);
      for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
        const long long row = PyLong_AsLongLong(r[i]);
        const double age = PyFloat_AsDouble(a[i]);
        PyObject* p = nullptr;
        if (!PyErr_Occurred()) {
          if (row < 0 || row >= classes) {
            PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is outside [0, %zd)", i, row,
                         classes);
          } else {
            p = PyFloat_FromDouble(resend(h + row * buckets, e, buckets, age, horizon));
          }
        }
        if (p == nullptr) {
          Py_CLEAR(out);
        } else {
          PyList_SET_ITEM(out, i, p);
        }
      }
    }
  }
  if (have_hazards) PyBuffer_Release(&hazards);
  if (have_edges) PyBuffer_Release(&edges);
  Py_DECREF(rows);
  Py_DECREF(ages);
  return out;
}

PyMethodDef methods[] = {
    {"resend_probabilities", resend_probabilities, METH_VARARGS,
     "resend_probabilities(hazards, rows, ages, horizon, edges) -> list[float]"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool kvci_add_resend(PyObject* module) { return PyModule_AddFunctions(module, methods) == 0; }
