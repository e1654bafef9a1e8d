// The RAM tier's per-page column kernels: what a request does to every page of its prompt (find
// how far it is loadable, pin, unpin) and to every page of a checkpoint that leaves (count the
// evictions that free it, drop its references), each one pass over the pages in one call.
//
// The page table keeps its columns as numpy arrays (kvci_plugin/tiering/ram/pages.py) and did
// this work as numpy expressions: five to ten array operations a call, each a Python call with
// its own temporaries, on vLLM's scheduler thread for every request and every eviction. These
// take the same arrays (any object with a C-contiguous buffer of the stated type), change them
// in place, and return only what the table's Python side needs (positions, counts). Every slot
// is checked against the columns' length before any change.
//
//   loadable_run(found, state, ready, tenant, tenant_no) -> int
//       how many leading slots of `found` (int64, -1: not held) are held, in state `ready`,
//       and of tenant number `tenant_no`
//   pin_pages(slots, pins, writer, no_writer) -> (first_pins, busy)
//       one more pin on each slot (a slot named twice is pinned twice): how many slots were
//       pinned for the first time, and how many of those had no writer
//   unpin_pages(slots, pins, writer, refs, no_writer) -> (unused, last_pins, busy) | None
//       one pin less on each slot; None, changing nothing, when a slot has fewer pins than it is
//       named; else the slots now unused (int64 bytes: no pin, no writer, no reference), how
//       many lost their last pin, and how many of those had no writer
//   add_pages(slots, refs, pins, state, writer, tenant, pool, tenant_no, pool_no, no_writer)
//       new pages at free slots: one reference, no pin, not ready, no writer, of tenant
//       number `tenant_no` and pool number `pool_no`
//   ref_pages(slots, refs)
//       one more reference on each slot (a reservation holding pages held already)
//   take_pages(slots, taken, refs, kept, plan, pins, writer, no_writer) -> bytes | None
//       one more holder taken by plan `plan` (> 0) counted on each slot: the positions (int64)
//       of the slots every holder of which is now taken and that the plan does not keep. A
//       slot's `taken` is (plan << 32) | count, and counts from zero under a plan that did not
//       write it; `kept` (int32) names the plan keeping the slot. So no column is reset after
//       a plan: the next plan's number leaves everything an earlier one wrote uncounted.
//       None, counting nothing, when a slot is pinned or being written (the holder cannot go):
//       the check and the count are one pass over the holder's pages.
//   release_pages(holders, writer_nos, refs, pins, writer, no_writer) -> (unused, counts, busy)
//       holder after holder (each a buffer of slots; its checkpoint number in `writer_nos`):
//       one reference less on each of its slots, and its copies dropped. The slots now unused
//       (int64 bytes, holder by holder, each in the order given: a page leaves with the last of
//       its holders to go), how many of them each holder freed (int64 bytes), and how many
//       slots stopped being busy. Every holder's slots are checked before anything changes;
//       a plan's victims go in one call, not one each.
//   held_conflict(slots, tenant, tenant_no, state, erased) -> int
//       the first position whose slot is another tenant's (2i) or being erased (2i + 1), or -1
//   write_pages(slots, state, ready, writer, writer_no, no_writer, pins) -> (mine, busy)
//       the slots not ready with no writer become writer `writer_no`'s: per position whether
//       its slot is that writer's (bool bytes), and how many slots became busy
//   written_pages(slots, state, ready, writer, writer_no, no_writer, pins) -> int
//       writer `writer_no`'s slots become ready: how many stopped being busy
#define PY_SSIZE_T_CLEAN
#include "page_columns.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum class Kind { kInt64, kInt32, kInt8, kBool };

bool format_is(const char* format, Kind kind, Py_ssize_t itemsize) {
  if (format == nullptr) return false;
  // numpy exports native byte order as a bare code; '<', '=' and '@' say the same here.
  if (*format == '<' || *format == '=' || *format == '@') ++format;
  switch (kind) {
    case Kind::kInt64:
      return itemsize == 8 && (std::strcmp(format, "q") == 0 || std::strcmp(format, "l") == 0);
    case Kind::kInt32:
      return itemsize == 4 && (std::strcmp(format, "i") == 0 || std::strcmp(format, "l") == 0);
    case Kind::kInt8:
      return itemsize == 1 && std::strcmp(format, "b") == 0;
    case Kind::kBool:
      return itemsize == 1 && std::strcmp(format, "?") == 0;
  }
  return false;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kInt64:
      return "int64";
    case Kind::kInt32:
      return "int32";
    case Kind::kInt8:
      return "int8";
    case Kind::kBool:
      return "bool";
  }
  return "?";
}

// A C-contiguous buffer of one type, released with its scope.
class Column {
 public:
  Column() = default;
  Column(const Column&) = delete;
  Column& operator=(const Column&) = delete;
  ~Column() {
    if (held_) PyBuffer_Release(&view_);
  }

  bool get(PyObject* obj, Kind kind, bool writable, const char* name) {
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) != 0) return false;
    held_ = true;
    if (!format_is(view_.format, kind, view_.itemsize)) {
      PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %s buffer", name,
                   kind_name(kind));
      return false;
    }
    return true;
  }

  Py_ssize_t size() const { return view_.len / view_.itemsize; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(view_.buf);
  }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// Slots: int64 or int32 (a checkpoint keeps its slots as int32), each checked in [0, limit).
bool read_slots(PyObject* obj, Py_ssize_t limit, std::vector<int64_t>& out) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
  const bool wide = format_is(view.format, Kind::kInt64, view.itemsize);
  if (!wide && !format_is(view.format, Kind::kInt32, view.itemsize)) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "slots must be a C-contiguous int64 or int32 buffer");
    return false;
  }
  const Py_ssize_t n = view.len / view.itemsize;
  out.resize(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t s = wide ? static_cast<const int64_t*>(view.buf)[i]
                           : int64_t(static_cast<const int32_t*>(view.buf)[i]);
    if (s < 0 || s >= limit) {
      PyBuffer_Release(&view);
      PyErr_Format(PyExc_ValueError, "slots[%zd] = %lld is outside [0, %zd)", i, (long long)s,
                   limit);
      return false;
    }
    out[size_t(i)] = s;
  }
  PyBuffer_Release(&view);
  return true;
}

// Every column the same length; that length.
bool same_length(std::initializer_list<const Column*> columns, Py_ssize_t* length) {
  *length = (*columns.begin())->size();
  for (const Column* c : columns) {
    if (c->size() != *length) {
      PyErr_SetString(PyExc_ValueError, "the columns must all be as long as the table");
      return false;
    }
  }
  return true;
}

PyObject* int64_bytes(const std::vector<int64_t>& values) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values.data()),
                                   Py_ssize_t(values.size() * 8));
}

PyObject* loadable_run(PyObject*, PyObject* args) {
  PyObject *found_obj, *state_obj, *tenant_obj;
  long long ready, tenant_no;
  if (!PyArg_ParseTuple(args, "OOLOL", &found_obj, &state_obj, &ready, &tenant_obj, &tenant_no)) {
    return nullptr;
  }
  Column found, state, tenant;
  Py_ssize_t length;
  if (!found.get(found_obj, Kind::kInt64, false, "found") ||
      !state.get(state_obj, Kind::kInt8, false, "state") ||
      !tenant.get(tenant_obj, Kind::kInt64, false, "tenant") ||
      !same_length({&state, &tenant}, &length)) {
    return nullptr;
  }
  const int64_t* f = found.as<int64_t>();
  const int8_t* st = state.as<int8_t>();
  const int64_t* tn = tenant.as<int64_t>();
  Py_ssize_t run = 0;
  for (; run < found.size(); ++run) {
    const int64_t s = f[run];
    if (s < 0) break;
    if (s >= length) {
      PyErr_Format(PyExc_ValueError, "found[%zd] = %lld is outside [0, %zd)", run,
                   (long long)s, length);
      return nullptr;
    }
    if (st[s] != ready || tn[s] != tenant_no) break;
  }
  return PyLong_FromSsize_t(run);
}

// The arguments pin_pages takes: (slots, pins, writer, no_writer).
struct Pins {
  Column pins, writer;
  std::vector<int64_t> slots;
  long long no_writer = 0;

  bool parse(PyObject* args) {
    PyObject *slots_obj, *pins_obj, *writer_obj;
    if (!PyArg_ParseTuple(args, "OOOL", &slots_obj, &pins_obj, &writer_obj, &no_writer)) {
      return false;
    }
    Py_ssize_t length;
    return pins.get(pins_obj, Kind::kInt64, true, "pins") &&
           writer.get(writer_obj, Kind::kInt64, false, "writer") &&
           same_length({&pins, &writer}, &length) && read_slots(slots_obj, length, slots);
  }
};

PyObject* pin_pages(PyObject*, PyObject* args) {
  Pins c;
  if (!c.parse(args)) return nullptr;
  int64_t* p = c.pins.as<int64_t>();
  const int64_t* w = c.writer.as<int64_t>();
  long long first = 0, busy = 0;
  for (int64_t s : c.slots) {
    if (p[s]++ == 0) {
      ++first;
      busy += w[s] == c.no_writer;
    }
  }
  return Py_BuildValue("LL", first, busy);
}

PyObject* unpin_pages(PyObject*, PyObject* args) {
  PyObject *slots_obj, *pins_obj, *writer_obj, *refs_obj;
  long long no_writer;
  if (!PyArg_ParseTuple(args, "OOOOL", &slots_obj, &pins_obj, &writer_obj, &refs_obj,
                        &no_writer)) {
    return nullptr;
  }
  Column pins, writer, refs;
  Py_ssize_t length;
  std::vector<int64_t> slots;
  if (!pins.get(pins_obj, Kind::kInt64, true, "pins") ||
      !writer.get(writer_obj, Kind::kInt64, false, "writer") ||
      !refs.get(refs_obj, Kind::kInt64, false, "refs") ||
      !same_length({&pins, &writer, &refs}, &length) || !read_slots(slots_obj, length, slots)) {
    return nullptr;
  }
  int64_t* p = pins.as<int64_t>();
  const int64_t* w = writer.as<int64_t>();
  const int64_t* r = refs.as<int64_t>();
  // Unpinned in order; a slot with no pin left to take undoes what was done, changing nothing.
  for (size_t i = 0; i < slots.size(); ++i) {
    if (p[slots[i]] <= 0) {
      for (size_t j = 0; j < i; ++j) ++p[slots[j]];
      Py_RETURN_NONE;
    }
    --p[slots[i]];
  }
  std::vector<int64_t> unused;
  long long last = 0, busy = 0;
  for (int64_t s : slots) {
    // A slot named twice reaches its last pin once: counted where it is 0 and not seen yet.
    if (p[s] == 0) {
      p[s] = -1;  // marks it counted; restored below
      ++last;
      if (w[s] == no_writer) {
        ++busy;
        if (r[s] == 0) unused.push_back(s);
      }
    }
  }
  for (int64_t s : slots) {
    if (p[s] == -1) p[s] = 0;
  }
  PyObject* out = int64_bytes(unused);
  if (out == nullptr) return nullptr;
  return Py_BuildValue("NLL", out, last, busy);
}

PyObject* add_pages(PyObject*, PyObject* args) {
  PyObject *slots_obj, *refs_obj, *pins_obj, *state_obj, *writer_obj, *tenant_obj, *pool_obj;
  long long tenant_no, pool_no, no_writer;
  if (!PyArg_ParseTuple(args, "OOOOOOOLLL", &slots_obj, &refs_obj, &pins_obj, &state_obj,
                        &writer_obj, &tenant_obj, &pool_obj, &tenant_no, &pool_no, &no_writer)) {
    return nullptr;
  }
  Column refs, pins, state, writer, tenant, pool;
  Py_ssize_t length;
  std::vector<int64_t> slots;
  if (!refs.get(refs_obj, Kind::kInt64, true, "refs") ||
      !pins.get(pins_obj, Kind::kInt64, true, "pins") ||
      !state.get(state_obj, Kind::kInt8, true, "state") ||
      !writer.get(writer_obj, Kind::kInt64, true, "writer") ||
      !tenant.get(tenant_obj, Kind::kInt64, true, "tenant") ||
      !pool.get(pool_obj, Kind::kInt64, true, "pool") ||
      !same_length({&refs, &pins, &state, &writer, &tenant, &pool}, &length) ||
      !read_slots(slots_obj, length, slots)) {
    return nullptr;
  }
  int64_t* r = refs.as<int64_t>();
  int64_t* p = pins.as<int64_t>();
  int8_t* st = state.as<int8_t>();
  int64_t* w = writer.as<int64_t>();
  int64_t* tn = tenant.as<int64_t>();
  int64_t* pl = pool.as<int64_t>();
  for (int64_t s : slots) {
    r[s] = 1;
    p[s] = 0;
    st[s] = 0;
    w[s] = no_writer;
    tn[s] = tenant_no;
    pl[s] = pool_no;
  }
  Py_RETURN_NONE;
}

PyObject* ref_pages(PyObject*, PyObject* args) {
  PyObject *slots_obj, *refs_obj;
  if (!PyArg_ParseTuple(args, "OO", &slots_obj, &refs_obj)) return nullptr;
  Column refs;
  std::vector<int64_t> slots;
  if (!refs.get(refs_obj, Kind::kInt64, true, "refs") ||
      !read_slots(slots_obj, refs.size(), slots)) {
    return nullptr;
  }
  int64_t* r = refs.as<int64_t>();
  for (int64_t s : slots) ++r[s];
  Py_RETURN_NONE;
}

PyObject* take_pages(PyObject*, PyObject* args) {
  PyObject *slots_obj, *taken_obj, *refs_obj, *kept_obj, *pins_obj, *writer_obj;
  long long plan, no_writer;
  if (!PyArg_ParseTuple(args, "OOOOLOOL", &slots_obj, &taken_obj, &refs_obj, &kept_obj, &plan,
                        &pins_obj, &writer_obj, &no_writer)) {
    return nullptr;
  }
  if (plan <= 0 || plan > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "plan must be in [1, 2^31), not %lld", plan);
    return nullptr;
  }
  Column taken, refs, kept, pins, writer;
  Py_ssize_t length;
  std::vector<int64_t> slots;
  if (!taken.get(taken_obj, Kind::kInt64, true, "taken") ||
      !refs.get(refs_obj, Kind::kInt64, false, "refs") ||
      !kept.get(kept_obj, Kind::kInt32, false, "kept") ||
      !pins.get(pins_obj, Kind::kInt64, false, "pins") ||
      !writer.get(writer_obj, Kind::kInt64, false, "writer") ||
      !same_length({&taken, &refs, &kept, &pins, &writer}, &length) ||
      !read_slots(slots_obj, length, slots)) {
    return nullptr;
  }
  int64_t* tk = taken.as<int64_t>();
  const int64_t* r = refs.as<int64_t>();
  const int32_t* k = kept.as<int32_t>();
  const int64_t* p = pins.as<int64_t>();
  const int64_t* w = writer.as<int64_t>();
  for (int64_t s : slots) {
    if (p[s] != 0 || w[s] != no_writer) Py_RETURN_NONE;
  }
  const int64_t mine = int64_t(plan) << 32;
  constexpr int64_t kCount = 0xFFFFFFFFLL;
  std::vector<int64_t> frees;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i];
    const int64_t count = ((tk[s] & ~kCount) == mine ? (tk[s] & kCount) : 0) + 1;
    tk[s] = mine | count;
    if (count == r[s] && k[s] != plan) frees.push_back(int64_t(i));
  }
  return int64_bytes(frees);
}

PyObject* release_pages(PyObject*, PyObject* args) {
  PyObject *holders_obj, *writers_obj, *refs_obj, *pins_obj, *writer_obj;
  long long no_writer;
  if (!PyArg_ParseTuple(args, "OOOOOL", &holders_obj, &writers_obj, &refs_obj, &pins_obj,
                        &writer_obj, &no_writer)) {
    return nullptr;
  }
  Column refs, pins, writer;
  Py_ssize_t length;
  if (!refs.get(refs_obj, Kind::kInt64, true, "refs") ||
      !pins.get(pins_obj, Kind::kInt64, false, "pins") ||
      !writer.get(writer_obj, Kind::kInt64, true, "writer") ||
      !same_length({&refs, &pins, &writer}, &length)) {
    return nullptr;
  }
  PyObject* holders = PySequence_Fast(holders_obj, "holders must be a sequence of slot buffers");
  if (holders == nullptr) return nullptr;
  PyObject* writers = PySequence_Fast(writers_obj, "writer_nos must be a sequence of ints");
  if (writers == nullptr) {
    Py_DECREF(holders);
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(holders);
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(n));
  std::vector<long long> nos(static_cast<size_t>(n));
  bool ok = PySequence_Fast_GET_SIZE(writers) == n;
  if (!ok) PyErr_SetString(PyExc_ValueError, "one writer number a holder");
  for (Py_ssize_t h = 0; ok && h < n; ++h) {
    ok = read_slots(PySequence_Fast_GET_ITEM(holders, h), length, slots[size_t(h)]);
    if (ok) {
      nos[size_t(h)] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(writers, h));
      ok = !(nos[size_t(h)] == -1 && PyErr_Occurred());
    }
  }
  Py_DECREF(holders);
  Py_DECREF(writers);
  if (!ok) return nullptr;
  int64_t* r = refs.as<int64_t>();
  const int64_t* p = pins.as<int64_t>();
  int64_t* w = writer.as<int64_t>();
  long long busy = 0;
  std::vector<int64_t> unused, counts(static_cast<size_t>(n));
  for (size_t h = 0; h < size_t(n); ++h) {
    for (int64_t s : slots[h]) {
      --r[s];
      if (w[s] == nos[h]) {
        busy += p[s] == 0;
        w[s] = no_writer;
      }
    }
    const size_t before = unused.size();
    for (int64_t s : slots[h]) {
      if (r[s] == 0 && p[s] == 0 && w[s] == no_writer) unused.push_back(s);
    }
    counts[h] = int64_t(unused.size() - before);
  }
  return Py_BuildValue("NNL", int64_bytes(unused), int64_bytes(counts), busy);
}

PyObject* held_conflict(PyObject*, PyObject* args) {
  PyObject *slots_obj, *tenant_obj, *state_obj;
  long long tenant_no, erased;
  if (!PyArg_ParseTuple(args, "OOLOL", &slots_obj, &tenant_obj, &tenant_no, &state_obj,
                        &erased)) {
    return nullptr;
  }
  Column tenant, state;
  Py_ssize_t length;
  std::vector<int64_t> slots;
  if (!tenant.get(tenant_obj, Kind::kInt64, false, "tenant") ||
      !state.get(state_obj, Kind::kInt8, false, "state") ||
      !same_length({&tenant, &state}, &length) || !read_slots(slots_obj, length, slots)) {
    return nullptr;
  }
  const int64_t* tn = tenant.as<int64_t>();
  const int8_t* st = state.as<int8_t>();
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i];
    if (tn[s] != tenant_no) return PyLong_FromLongLong(2 * (long long)i);
    if (st[s] & erased) return PyLong_FromLongLong(2 * (long long)i + 1);
  }
  return PyLong_FromLong(-1);
}

// The columns write_pages and written_pages read: parsed alike.
struct Writes {
  Column state, writer, pins;
  std::vector<int64_t> slots;
  long long ready = 0, writer_no = 0, no_writer = 0;

  bool parse(PyObject* args) {
    PyObject *slots_obj, *state_obj, *writer_obj, *pins_obj;
    if (!PyArg_ParseTuple(args, "OOLOLLO", &slots_obj, &state_obj, &ready, &writer_obj,
                          &writer_no, &no_writer, &pins_obj)) {
      return false;
    }
    Py_ssize_t length;
    return state.get(state_obj, Kind::kInt8, true, "state") &&
           writer.get(writer_obj, Kind::kInt64, true, "writer") &&
           pins.get(pins_obj, Kind::kInt64, false, "pins") &&
           same_length({&state, &writer, &pins}, &length) &&
           read_slots(slots_obj, length, slots);
  }
};

PyObject* write_pages(PyObject*, PyObject* args) {
  Writes c;
  if (!c.parse(args)) return nullptr;
  const int8_t* st = c.state.as<int8_t>();
  int64_t* w = c.writer.as<int64_t>();
  const int64_t* p = c.pins.as<int64_t>();
  long long busy = 0;
  std::vector<char> mine(c.slots.size());
  for (size_t i = 0; i < c.slots.size(); ++i) {
    const int64_t s = c.slots[i];
    if ((st[s] & c.ready) == 0 && w[s] == c.no_writer) {
      w[s] = c.writer_no;
      busy += p[s] == 0;
    }
    mine[i] = w[s] == c.writer_no;
  }
  PyObject* out = PyBytes_FromStringAndSize(mine.data(), Py_ssize_t(mine.size()));
  if (out == nullptr) return nullptr;
  return Py_BuildValue("NL", out, busy);
}

PyObject* written_pages(PyObject*, PyObject* args) {
  Writes c;
  if (!c.parse(args)) return nullptr;
  int8_t* st = c.state.as<int8_t>();
  int64_t* w = c.writer.as<int64_t>();
  const int64_t* p = c.pins.as<int64_t>();
  long long idle = 0;
  for (int64_t s : c.slots) {
    if (w[s] == c.writer_no) {
      st[s] = int8_t(st[s] | c.ready);
      w[s] = c.no_writer;
      idle += p[s] == 0;
    }
  }
  return PyLong_FromLongLong(idle);
}

PyMethodDef methods[] = {
    {"held_conflict", held_conflict, METH_VARARGS,
     "held_conflict(slots, tenant, tenant_no, state, erased) -> int: 2i, 2i + 1, or -1"},
    {"write_pages", write_pages, METH_VARARGS,
     "write_pages(slots, state, ready, writer, writer_no, no_writer, pins) -> (mine, busy)"},
    {"written_pages", written_pages, METH_VARARGS,
     "written_pages(slots, state, ready, writer, writer_no, no_writer, pins) -> int"},
    {"loadable_run", loadable_run, METH_VARARGS,
     "loadable_run(found, state, ready, tenant, tenant_no) -> int: the leading slots loadable"},
    {"pin_pages", pin_pages, METH_VARARGS,
     "pin_pages(slots, pins, writer, no_writer) -> (first_pins, busy)"},
    {"unpin_pages", unpin_pages, METH_VARARGS,
     "unpin_pages(slots, pins, writer, refs, no_writer) -> (unused, last_pins, busy) | None"},
    {"add_pages", add_pages, METH_VARARGS,
     "add_pages(slots, refs, pins, state, writer, tenant, pool, tenant_no, pool_no, no_writer)"},
    {"ref_pages", ref_pages, METH_VARARGS,
     "ref_pages(slots, refs): one more reference on each slot"},
    {"take_pages", take_pages, METH_VARARGS,
     "take_pages(slots, taken, refs, kept, plan, pins, writer, no_writer) -> bytes | None: "
     "positions freed by taking them; None when one is busy"},
    {"release_pages", release_pages, METH_VARARGS,
     "release_pages(holders, writer_nos, refs, pins, writer, no_writer) -> "
     "(unused, counts, busy)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

bool kvci_add_page_columns(PyObject* module) {
  return PyModule_AddFunctions(module, methods) == 0;
}
