// resend_probabilities: the value policy's reuse hazard, for every head an eviction weighs in
// one call (kvci_plugin/policy/reuse_hazard.py, ReuseHazard.resend_probability, is the same
// computation for one context, and the reference this must equal bit for bit: the simulator's
// figures must not move because the engine weighs in C).
//
//   resend_probabilities(hazards, rows, ages, horizon, edges) -> bytes
//       hazards: float64 (classes x buckets), C-contiguous; rows: int64, the class row of each
//       context; ages: float64, each context's idle age; edges: float64, the buckets' starts.
//       Per context (float64): 1 - exp(-H), H the hazard integrated from its age to its age +
//       horizon, bucket by bucket in ascending order, as the Python loop adds it.
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

bool int64_buffer(PyObject* obj, Py_buffer* view, const char* name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
  const char* f = view->format;
  if (f != nullptr && (*f == '<' || *f == '=' || *f == '@')) ++f;
  if (view->itemsize != 8 || f == nullptr || (std::strcmp(f, "q") != 0 && std::strcmp(f, "l") != 0)) {
    PyBuffer_Release(view);
    PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous int64 buffer", name);
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
  Py_buffer hazards, rows, ages, edges;
  if (!float64_buffer(hazards_obj, &hazards, "hazards")) return nullptr;
  if (!int64_buffer(rows_obj, &rows, "rows")) {
    PyBuffer_Release(&hazards);
    return nullptr;
  }
  if (!float64_buffer(ages_obj, &ages, "ages")) {
    PyBuffer_Release(&hazards);
    PyBuffer_Release(&rows);
    return nullptr;
  }
  if (!float64_buffer(edges_obj, &edges, "edges")) {
    PyBuffer_Release(&hazards);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&ages);
    return nullptr;
  }
  PyObject* out = nullptr;
  const Py_ssize_t buckets = edges.len / 8;
  const Py_ssize_t n = rows.len / 8;
  const Py_ssize_t classes = buckets > 0 ? hazards.len / 8 / buckets : 0;
  if (buckets == 0 || hazards.len != classes * buckets * 8) {
    PyErr_SetString(PyExc_ValueError, "hazards must hold one row of len(edges) per class");
  } else if (ages.len / 8 != n) {
    PyErr_SetString(PyExc_ValueError, "rows and ages must be as long");
  } else {
    const auto* h = static_cast<const double*>(hazards.buf);
    const auto* r = static_cast<const int64_t*>(rows.buf);
    const auto* a = static_cast<const double*>(ages.buf);
    const auto* e = static_cast<const double*>(edges.buf);
    std::vector<double> p(static_cast<size_t>(n));
    bool ok = true;
    for (Py_ssize_t i = 0; i < n && ok; ++i) {
      if (r[i] < 0 || r[i] >= classes) {
        PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is outside [0, %zd)", i,
                     (long long)r[i], classes);
        ok = false;
      } else {
        p[size_t(i)] = resend(h + r[i] * buckets, e, buckets, a[i], horizon);
      }
    }
    if (ok) {
      out = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(p.data()), n * 8);
    }
  }
  PyBuffer_Release(&hazards);
  PyBuffer_Release(&rows);
  PyBuffer_Release(&ages);
  PyBuffer_Release(&edges);
  return out;
}

PyMethodDef methods[] = {
    {"resend_probabilities", resend_probabilities, METH_VARARGS,
     "resend_probabilities(hazards, rows, ages, horizon, edges) -> bytes: float64 each"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool kvci_add_resend(PyObject* module) { return PyModule_AddFunctions(module, methods) == 0; }
