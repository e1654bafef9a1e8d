// idle_cells: the value policy's open idle periods counted and summed per class and bucket.
#pragma once

#include <Python.h>

// Adds the function to the module; false with a Python error set on failure.
bool kvci_add_idle_cells(PyObject* module);
