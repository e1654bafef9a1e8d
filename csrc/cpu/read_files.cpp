// read_files(paths, out) -> list[int]: file i's bytes into row i of the writable C-contiguous
// buffer `out` (len(out) / len(paths) bytes a row). Returns per file its size when it fitted its
// row and was read (a file that shrank while read: the bytes there were), else -errno (-EFBIG:
// larger than its row; -EISDIR, -EINVAL: not a regular file; each left unread).
// A prefix load reads a blob per page. With Python's os.open/fstat/preadv/close a reader needs the
// GIL between every call, and a thread reading beside the one that decrypts spent its time
// waiting for it; here the whole batch runs without the GIL.
#include "read_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <vector>

namespace {

int64_t read_one(const char* path, char* row, int64_t row_bytes) {
  int fd;
  do {
    // O_NONBLOCK: a FIFO in a file's place must not hang the batch (no effect on a file).
    // O_NOFOLLOW: a symlink planted in a shared folder must not point a reader at a device.
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return -errno;
  int64_t result = 0;
  struct stat st;
  if (fstat(fd, &st) != 0) {
    result = -errno;
  } else if (!S_ISREG(st.st_mode)) {
    result = S_ISDIR(st.st_mode) ? -EISDIR : -EINVAL;
  } else if (st.st_size > row_bytes) {
    result = -EFBIG;
  } else {
    while (result < st.st_size) {
      const ssize_t got = pread(fd, row + result, size_t(st.st_size - result), off_t(result));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) {
        result = -errno;
        break;
      }
      if (got == 0) break;  // shorter than its size a moment ago: the caller's checks refuse it
      result += got;
    }
  }
  close(fd);
  return result;
}

}  // namespace

PyObject* kvci_read_files(PyObject* /*module*/, PyObject* args) {
  PyObject* sequence = nullptr;
  PyObject* out = nullptr;
  if (!PyArg_ParseTuple(args, "OO:read_files", &sequence, &out)) return nullptr;
  PyObject* items = PySequence_Fast(sequence, "paths must be a sequence");
  if (items == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  std::vector<PyObject*> encoded;  // bytes objects, owned
  encoded.reserve(size_t(n));
  bool ok = true;
  for (Py_ssize_t i = 0; i < n && ok; ++i) {
    PyObject* path = nullptr;
    ok = PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(items, i), &path) != 0;
    if (ok) encoded.push_back(path);
  }
  Py_DECREF(items);
  Py_buffer view;
  if (ok && PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) ok = false;
  PyObject* result = nullptr;
  if (ok) {
    if (n > 0 && view.len % n != 0) {
      PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not a whole row for each of %zd paths",
                   view.len, n);
    } else {
      const int64_t row_bytes = n > 0 ? int64_t(view.len / n) : 0;
      std::vector<int64_t> sizes(static_cast<size_t>(n));
      char* base = static_cast<char*>(view.buf);
      Py_BEGIN_ALLOW_THREADS;
      for (Py_ssize_t i = 0; i < n; ++i) {
        sizes[size_t(i)] = read_one(PyBytes_AS_STRING(encoded[size_t(i)]), base + i * row_bytes,
                                    row_bytes);
      }
      Py_END_ALLOW_THREADS;
      result = PyList_New(n);
      for (Py_ssize_t i = 0; result != nullptr && i < n; ++i) {
        PyObject* size = PyLong_FromLongLong(sizes[size_t(i)]);
        if (size == nullptr) {
          Py_CLEAR(result);
          break;
        }
        PyList_SET_ITEM(result, i, size);
      }
    }
    PyBuffer_Release(&view);
  }
  for (PyObject* path : encoded) Py_DECREF(path);
  return result;
}
