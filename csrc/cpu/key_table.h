// KeyTable: the RAM tier's page keys (16 bytes each) -> slot numbers, a prompt's keys per call.
#pragma once

#include <Python.h>

// Adds the KeyTable type to the module; false with a Python error set on failure.
bool kvci_add_key_table(PyObject* module);
