// untrack_leaf: take a record the garbage collector need not walk out of its generations.
#pragma once

#include <Python.h>

// Adds the function to the module; false with a Python error set on failure.
bool kvci_add_gc_leaf(PyObject* module);
