// read_files: many small files into the rows of one buffer, without the GIL.
#pragma once

#include <Python.h>

PyObject* kvci_read_files(PyObject* module, PyObject* args);
