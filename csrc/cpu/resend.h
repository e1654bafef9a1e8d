// resend_probabilities: the value policy's reuse hazard for many contexts in one call.
#pragma once

#include <Python.h>

// Adds the function to the module; false with a Python error set on failure.
bool kvci_add_resend(PyObject* module);
