// The RAM tier's per-page column kernels (loadable_run, pin_pages, unpin_pages, add_pages,
// ref_pages, take_pages, release_pages, held_conflict, write_pages, written_pages): a prompt's
// or a checkpoint's pages in one pass over the page table's columns.
#pragma once

#include <Python.h>

// Adds the kernels to the module; false with a Python error set on failure.
bool kvci_add_page_columns(PyObject* module);
