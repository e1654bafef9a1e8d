// untrack_leaf(obj) -> bool: stop the cyclic garbage collector walking `obj` when nothing it
// refers to, but its type, is an object the collector walks.
//
// Such a record can be in no reference cycle: a cycle through it would have to pass through one
// of its referents, and none of them refers to anything the collector tracks. Reference counting
// frees it as before. CPython does the same for its own leaves (a tuple or dict of atomic values
// is untracked, `_PyTuple_MaybeUntrack`, `MAINTAIN_TRACKING`), but never for instances of a
// class: a tier of 10^6 pages holds thousands of per-checkpoint records whose fields are strings,
// numbers, bytes and numpy arrays, and each young collection walked every one made since the
// last, a pause that grew with the tier (issue #51).
//
// A record whose referents include a tracked container stays tracked (false). A record untracked
// here must not later be made to refer to anything that can refer back to it.
#define PY_SSIZE_T_CLEAN
#include "gc_leaf.h"

namespace {

int refuse_tracked(PyObject* referent, void* self_type) {
  if (referent == static_cast<PyObject*>(self_type)) {
    return 0;  // a heap type's instance visits its type; the type is not the instance's leaf
  }
  return PyObject_IS_GC(referent) && PyObject_GC_IsTracked(referent) ? 1 : 0;
}

PyObject* untrack_leaf(PyObject*, PyObject* obj) {
  if (!PyObject_IS_GC(obj) || !PyObject_GC_IsTracked(obj)) {
    Py_RETURN_FALSE;
  }
  traverseproc traverse = Py_TYPE(obj)->tp_traverse;
  if (traverse == nullptr || traverse(obj, refuse_tracked, Py_TYPE(obj)) != 0) {
    Py_RETURN_FALSE;
  }
  PyObject_GC_UnTrack(obj);
  Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"untrack_leaf", untrack_leaf, METH_O,
     "untrack_leaf(obj) -> bool: the collector stops walking obj when it refers to nothing it "
     "walks (but its type)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool kvci_add_gc_leaf(PyObject* module) { return PyModule_AddFunctions(module, methods) == 0; }
