// KeyTable(capacity): which slot of the RAM tier holds each 16-byte page key.
//
// The RAM index asks this for every page of a prompt on vLLM's scheduler thread, several times a
// request (its lookup, a load's pin and unpin, a store's reservation). A Python dict of bytes
// keys costs a key object (~64 bytes) and a dict entry per page, every lookup a Python call per
// key, and at a million pages ~115 bytes of RAM a page. Here a prompt's keys are checked and
// looked up in one call (an open-addressing table, linear probing, at most half full), and a page
// costs its 16 key bytes in a column indexed by slot plus two 8-byte buckets.
//
//   check(keys) -> int           (static) how many keys, each checked as find checks them
//   distinct(keys) -> bool       (static) whether no key repeats, each checked
//   find(keys) -> bytes          int64 per key: its slot, or -1 when no slot holds it
//   find_held(keys) -> list      (position, slot) of each key held, in order (find's answer)
//   grow(capacity)               hold slots up to a larger capacity, the keys kept
//   insert(keys, slots)          hold each key at its slot (an int64 buffer); all or nothing
//   remove(slots)                drop the keys held at these slots; all or nothing
//   keys_at(slots) -> list       the keys held at these slots
//   find_last_from(other, slots, end) -> (position, slot)
//                                of the keys `other` (a KeyTable) holds at these slots, the last
//                                of the first `end` this table holds, without a key object made
//                                for each: probed back from `end`, stopped at the first found;
//                                (-1, -1) when none is
//   held() -> bytes              int64: every slot holding a key, in ascending order
//   clear(), len()
//
// `keys` is any sequence of bytes objects of exactly 16 bytes; anything else raises TypeError
// naming its position (the index turns it into its own precise error).
//
// A request's calls find the same prompt several times (its lookup, its load's pin and unpin,
// its store), or a leading part of it: find remembers its last answer with the key objects it
// was given (references held, so an address is never another key's) and answers a call whose
// keys are the same objects, or a leading run of them, from it while no key came or went.
#include "key_table.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace {

// At a million pages the buckets and the key column are 16 MiB each, and a prompt's keys land
// all over them: with 4 KiB pages nearly every probe also misses the TLB (a two-level page walk
// under a hypervisor). Large columns ask the kernel for 2 MiB pages where it grants them on
// request (transparent huge pages in "madvise" mode); where it does not, nothing changes.
constexpr size_t kHugePage = size_t(2) << 20;

template <typename T>
struct HugePages {
  using value_type = T;
  HugePages() = default;
  template <typename U>
  HugePages(const HugePages<U>&) {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) {
      if (void* p = std::malloc(bytes)) return static_cast<T*>(p);
      throw std::bad_alloc();
    }
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, rounded);
    if (p == nullptr) throw std::bad_alloc();
    madvise(p, rounded, MADV_HUGEPAGE);  // advice only: its failure changes nothing
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const HugePages<U>&) const { return true; }
  template <typename U>
  bool operator!=(const HugePages<U>&) const { return false; }
};

constexpr Py_ssize_t kKeyBytes = 16;
constexpr int64_t kMaxCapacity = (int64_t(1) << 31) - 1;

struct Key {
  uint64_t lo, hi;
  bool operator==(const Key& o) const { return lo == o.lo && hi == o.hi; }
};

uint64_t hash_of(const Key& k) {
  // Production keys are SipHash outputs, but tests and benchmarks use structured ones: mix.
  uint64_t h = k.lo ^ (k.hi * 0x9E3779B97F4A7C15ULL);
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ULL;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBULL;
  h ^= h >> 31;
  return h;
}

// A bucket: 0 when empty, else (the key's hash tag << 32) | (slot + 1). The tag spares a read of
// the key column for every bucket a probe passes.
struct Table {
  std::vector<uint64_t, HugePages<uint64_t>> buckets;
  uint64_t version = 0;  // moves with every insert, remove, clear and grow
  std::vector<Key, HugePages<Key>> keys;  // by slot
  std::vector<uint8_t> used;  // by slot
  uint64_t mask = 0;
  Py_ssize_t size = 0;

  explicit Table(int64_t capacity) : keys(size_t(capacity)), used(size_t(capacity), 0) {
    size_buckets(capacity);
  }

  void size_buckets(int64_t capacity) {
    uint64_t n = 8;
    while (n < uint64_t(capacity) * 2) n <<= 1;
    buckets.assign(n, 0);
    mask = n - 1;
  }

  // Slots up to `capacity` (not below the present one), every key kept at its slot.
  void grow(int64_t capacity) {
    keys.resize(size_t(capacity));
    used.resize(size_t(capacity), 0);
    size_buckets(capacity);
    const Py_ssize_t held = size;
    for (size_t s = 0; s < used.size(); ++s) {
      if (used[s]) {
        --size;  // insert counts it again
        insert(keys[s], int64_t(s));
      }
    }
    size = held;
    ++version;
  }

  static uint64_t tag_of(uint64_t h) { return h >> 32; }
  // A key's home bucket is named by its tag's low bits: a removal finds the home of each bucket
  // it may shift from the bucket alone, not by reading and hashing that bucket's key (a cache
  // miss each at a million pages). The tag's higher bits still tell apart keys of one home.
  uint64_t home_of(uint64_t h) const { return tag_of(h) & mask; }

  // The bucket holding `k`, or the empty bucket where it would go.
  uint64_t probe(const Key& k, uint64_t h, bool* found) const {
    const uint64_t tag = tag_of(h);
    for (uint64_t i = home_of(h);; i = (i + 1) & mask) {
      const uint64_t b = buckets[i];
      if (b == 0) {
        *found = false;
        return i;
      }
      if ((b >> 32) == tag && keys[size_t((b & 0xFFFFFFFFULL) - 1)] == k) {
        *found = true;
        return i;
      }
    }
  }

  int64_t find(const Key& k) const { return find_hashed(k, hash_of(k)); }

  int64_t find_hashed(const Key& k, uint64_t h) const {
    bool found;
    const uint64_t i = probe(k, h, &found);
    return found ? int64_t(buckets[i] & 0xFFFFFFFFULL) - 1 : -1;
  }

  // Each key's slot or -1. At a million pages a probe's bucket and key are cache misses, one
  // after the other for each key: the buckets of every key are fetched first, then the keys
  // their first buckets name, then the probes run on what is cached.
  void find_all(const std::vector<Key>& ks, std::vector<int64_t>& out) const {
    const size_t n = ks.size();
    std::vector<uint64_t> hs(n);
    for (size_t i = 0; i < n; ++i) {
      hs[i] = hash_of(ks[i]);
      __builtin_prefetch(&buckets[home_of(hs[i])]);
    }
    for (size_t i = 0; i < n; ++i) {
      const uint64_t b = buckets[home_of(hs[i])];
      if (b != 0) __builtin_prefetch(&keys[size_t((b & 0xFFFFFFFFULL) - 1)]);
    }
    out.resize(n);
    for (size_t i = 0; i < n; ++i) out[i] = find_hashed(ks[i], hs[i]);
  }

  void insert(const Key& k, int64_t slot) { insert_hashed(k, hash_of(k), slot); }

  // `k` (hashed `h`) held at `slot`; false, changing nothing, when it is held already.
  bool insert_hashed(const Key& k, uint64_t h, int64_t slot) {
    bool found;
    const uint64_t i = probe(k, h, &found);
    if (found) return false;
    buckets[i] = (tag_of(h) << 32) | uint64_t(slot + 1);
    keys[size_t(slot)] = k;
    used[size_t(slot)] = 1;
    ++size;
    ++version;
    return true;
  }

  void remove(int64_t slot) {
    const Key& k = keys[size_t(slot)];
    bool found;
    uint64_t i = probe(k, hash_of(k), &found);
    // Backward-shift deletion: no tombstones, so probes stay short however many keys came and
    // went.
    for (uint64_t j = (i + 1) & mask; buckets[j] != 0; j = (j + 1) & mask) {
      const uint64_t home = (buckets[j] >> 32) & mask;
      // The entry at j may move to i unless its home lies cyclically in (i, j].
      const bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
      if (!stays) {
        buckets[i] = buckets[j];
        i = j;
      }
    }
    buckets[i] = 0;
    used[size_t(slot)] = 0;
    --size;
    ++version;
  }
};

// find's last answer: the key objects it was given (strong references) and their slots.
struct Memo {
  std::vector<PyObject*> items;
  std::vector<int64_t> slots;
  uint64_t version = 0;

  void forget() {
    for (PyObject* o : items) Py_DECREF(o);
    items.clear();
    slots.clear();
  }

  // The slots of `n` keys that are the remembered objects' leading run, or nullptr.
  const int64_t* answer(PyObject** item, Py_ssize_t n, uint64_t now) const {
    if (version != now || n == 0 || size_t(n) > items.size()) return nullptr;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (item[i] != items[size_t(i)]) return nullptr;
    }
    return slots.data();
  }

  void keep(PyObject** item, Py_ssize_t n, std::vector<int64_t>&& found, uint64_t now) {
    forget();
    items.assign(item, item + n);
    for (PyObject* o : items) Py_INCREF(o);
    slots = std::move(found);
    version = now;
  }
};

struct KeyTableObject {
  PyObject_HEAD
  Table* table;
  Memo* memo;
};

// Each of n key objects into dst; false with TypeError naming the first bad position.
bool read_items(PyObject** item, Py_ssize_t n, std::vector<Key>& dst) {
  dst.resize(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyBytes_Check(item[i]) || PyBytes_GET_SIZE(item[i]) != kKeyBytes) {
      PyErr_Format(PyExc_TypeError, "keys[%zd] is not a 16-byte bytes object", i);
      return false;
    }
    std::memcpy(&dst[size_t(i)], PyBytes_AS_STRING(item[i]), kKeyBytes);
  }
  return true;
}

// Each key of `sequence` into dst; false with TypeError naming the first bad position.
bool read_keys(PyObject* sequence, std::vector<Key>& dst) {
  PyObject* items = PySequence_Fast(sequence, "keys must be a sequence of 16-byte bytes");
  if (items == nullptr) return false;
  const bool ok = read_items(PySequence_Fast_ITEMS(items), PySequence_Fast_GET_SIZE(items), dst);
  Py_DECREF(items);
  return ok;
}

// The int64 slots of a C-contiguous buffer, each checked in [0, capacity).
bool read_slots(PyObject* obj, const Table& t, std::vector<int64_t>& dst) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
  const bool int64 = view.itemsize == 8 && view.format != nullptr &&
                     (std::strcmp(view.format, "q") == 0 || std::strcmp(view.format, "l") == 0 ||
                      std::strcmp(view.format, "<q") == 0 || std::strcmp(view.format, "<l") == 0 ||
                      std::strcmp(view.format, "=q") == 0);
  if (!int64) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "slots must be a C-contiguous int64 buffer");
    return false;
  }
  const Py_ssize_t n = view.len / 8;
  dst.resize(size_t(n));
  std::memcpy(dst.data(), view.buf, size_t(view.len));
  PyBuffer_Release(&view);
  const int64_t capacity = int64_t(t.used.size());
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (dst[size_t(i)] < 0 || dst[size_t(i)] >= capacity) {
      PyErr_Format(PyExc_ValueError, "slots[%zd] = %lld is outside [0, %lld)", i,
                   (long long)dst[size_t(i)], (long long)capacity);
      return false;
    }
  }
  return true;
}

PyObject* int64_bytes(const std::vector<int64_t>& values) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values.data()),
                                   Py_ssize_t(values.size() * 8));
}

PyObject* kt_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"capacity", nullptr};
  long long capacity = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L", const_cast<char**>(names), &capacity)) {
    return nullptr;
  }
  if (capacity < 1 || capacity > kMaxCapacity) {
    PyErr_Format(PyExc_ValueError, "capacity must be in [1, %lld], not %lld",
                 (long long)kMaxCapacity, capacity);
    return nullptr;
  }
  auto* self = reinterpret_cast<KeyTableObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->table = new (std::nothrow) Table(capacity);
  self->memo = new (std::nothrow) Memo();
  if (self->table == nullptr || self->memo == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

void kt_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<KeyTableObject*>(obj);
  if (self->memo != nullptr) self->memo->forget();
  delete self->memo;
  delete self->table;
  Py_TYPE(obj)->tp_free(obj);
}

Table& table_of(PyObject* self) { return *reinterpret_cast<KeyTableObject*>(self)->table; }

PyObject* kt_find(PyObject* self, PyObject* keys) {
  PyObject* items = PySequence_Fast(keys, "keys must be a sequence of 16-byte bytes");
  if (items == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject** item = PySequence_Fast_ITEMS(items);
  const Table& t = table_of(self);
  Memo& memo = *reinterpret_cast<KeyTableObject*>(self)->memo;
  if (const int64_t* known = memo.answer(item, n, t.version)) {
    Py_DECREF(items);
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(known), n * 8);
  }
  std::vector<Key> ks;
  if (!read_items(item, n, ks)) {
    Py_DECREF(items);
    return nullptr;
  }
  std::vector<int64_t> out;
  t.find_all(ks, out);
  PyObject* answer = int64_bytes(out);
  if (answer != nullptr && n > 0) memo.keep(item, n, std::move(out), t.version);
  Py_DECREF(items);
  return answer;
}

// find's answer reduced to the keys held: [(position, slot), ...] in order. A prompt probed for
// the few keys it holds among hundreds (the value policy's anchors) gets those alone, with no
// array of every key's slot to filter.
PyObject* kt_find_held(PyObject* self, PyObject* keys) {
  PyObject* found = kt_find(self, keys);
  if (found == nullptr) return nullptr;
  const int64_t* slot = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(found));
  const Py_ssize_t n = PyBytes_GET_SIZE(found) / 8;
  PyObject* out = PyList_New(0);
  for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
    if (slot[i] < 0) continue;
    PyObject* pair = Py_BuildValue("nL", i, (long long)slot[i]);
    if (pair == nullptr || PyList_Append(out, pair) != 0) Py_CLEAR(out);
    Py_XDECREF(pair);
  }
  Py_DECREF(found);
  return out;
}

PyObject* kt_grow(PyObject* self, PyObject* arg) {
  const long long capacity = PyLong_AsLongLong(arg);
  if (capacity == -1 && PyErr_Occurred()) return nullptr;
  Table& t = table_of(self);
  if (capacity < (long long)t.used.size() || capacity > kMaxCapacity) {
    PyErr_Format(PyExc_ValueError, "capacity must be in [%lld, %lld], not %lld",
                 (long long)t.used.size(), (long long)kMaxCapacity, capacity);
    return nullptr;
  }
  try {
    t.grow(capacity);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  Py_RETURN_NONE;
}

PyObject* kt_check(PyObject*, PyObject* keys) {
  std::vector<Key> ks;
  if (!read_keys(keys, ks)) return nullptr;
  return PyLong_FromSize_t(ks.size());
}

PyObject* kt_distinct(PyObject*, PyObject* keys) {
  std::vector<Key> ks;
  if (!read_keys(keys, ks)) return nullptr;
  // A set of positions, open addressing: a store's keys are checked for a repeat in one pass
  // (a Python set hashed every key object anew: each request's keys are new objects).
  size_t n = 8;
  while (n < ks.size() * 2) n <<= 1;
  std::vector<uint32_t> seen(n, 0);  // position + 1
  for (size_t i = 0; i < ks.size(); ++i) {
    for (size_t j = hash_of(ks[i]) & (n - 1);; j = (j + 1) & (n - 1)) {
      if (seen[j] == 0) {
        seen[j] = uint32_t(i + 1);
        break;
      }
      if (ks[seen[j] - 1] == ks[i]) Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

PyObject* kt_insert(PyObject* self, PyObject* args) {
  PyObject *keys, *slots_obj;
  if (!PyArg_ParseTuple(args, "OO", &keys, &slots_obj)) return nullptr;
  Table& t = table_of(self);
  std::vector<Key> ks;
  std::vector<int64_t> slots;
  if (!read_keys(keys, ks) || !read_slots(slots_obj, t, slots)) return nullptr;
  if (ks.size() != slots.size()) {
    PyErr_Format(PyExc_ValueError, "%zu keys but %zu slots", ks.size(), slots.size());
    return nullptr;
  }
  // Each key hashed once and its bucket fetched before the probes (as find_all does).
  std::vector<uint64_t> hs(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    hs[i] = hash_of(ks[i]);
    __builtin_prefetch(&t.buckets[t.home_of(hs[i])]);
  }
  // Checked whole before any change: a refused insert changes nothing.
  for (size_t i = 0; i < ks.size(); ++i) {
    if (t.used[size_t(slots[i])]) {
      PyErr_Format(PyExc_ValueError, "slot %lld already holds a key", (long long)slots[i]);
      return nullptr;
    }
    if (t.find_hashed(ks[i], hs[i]) >= 0) {
      PyErr_Format(PyExc_ValueError, "keys[%zu] is held already", i);
      return nullptr;
    }
  }
  size_t done = 0;
  for (; done < ks.size(); ++done) {
    // A key or slot repeated within the call is found held by its earlier insert.
    if (t.used[size_t(slots[done])] || !t.insert_hashed(ks[done], hs[done], slots[done])) break;
  }
  if (done < ks.size()) {
    for (size_t i = 0; i < done; ++i) t.remove(slots[i]);
    PyErr_Format(PyExc_ValueError, "keys[%zu] or its slot %lld repeats an earlier one", done,
                 (long long)slots[done]);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* kt_remove(PyObject* self, PyObject* slots_obj) {
  Table& t = table_of(self);
  std::vector<int64_t> slots;
  if (!read_slots(slots_obj, t, slots)) return nullptr;
  for (int64_t s : slots) {
    if (!t.used[size_t(s)]) {
      PyErr_Format(PyExc_ValueError, "slot %lld holds no key", (long long)s);
      return nullptr;
    }
  }
  size_t done = 0;
  for (; done < slots.size(); ++done) {
    if (!t.used[size_t(slots[done])]) break;  // repeated within the call
    t.remove(slots[done]);
  }
  if (done < slots.size()) {
    PyErr_Format(PyExc_ValueError, "slot %lld is named twice (its key was removed once)",
                 (long long)slots[done]);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* kt_keys_at(PyObject* self, PyObject* slots_obj) {
  const Table& t = table_of(self);
  std::vector<int64_t> slots;
  if (!read_slots(slots_obj, t, slots)) return nullptr;
  PyObject* out = PyList_New(Py_ssize_t(slots.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!t.used[size_t(slots[i])]) {
      Py_DECREF(out);
      PyErr_Format(PyExc_ValueError, "slot %lld holds no key", (long long)slots[i]);
      return nullptr;
    }
    PyObject* key = PyBytes_FromStringAndSize(
        reinterpret_cast<const char*>(&t.keys[size_t(slots[i])]), kKeyBytes);
    if (key == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, Py_ssize_t(i), key);
  }
  return out;
}

PyTypeObject KeyTableType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* kt_find_last_from(PyObject* self, PyObject* args) {
  PyObject *other, *slots_obj;
  Py_ssize_t end;
  if (!PyArg_ParseTuple(args, "O!On", &KeyTableType, &other, &slots_obj, &end)) return nullptr;
  const Table& from = table_of(other);
  std::vector<int64_t> slots;
  if (!read_slots(slots_obj, from, slots)) return nullptr;
  if (end < 0 || size_t(end) > slots.size()) {
    PyErr_Format(PyExc_ValueError, "end = %zd is outside [0, %zu]", end, slots.size());
    return nullptr;
  }
  const Table& t = table_of(self);
  // A chunk's buckets are fetched at once (as find_all does), then probed from its end: what is
  // looked for is most often a few keys from `end`.
  constexpr size_t kChunk = 16;
  Key ks[kChunk];
  uint64_t hs[kChunk];
  for (size_t hi = size_t(end); hi > 0;) {
    const size_t lo = hi > kChunk ? hi - kChunk : 0;
    for (size_t i = lo; i < hi; ++i) {
      const size_t s = size_t(slots[i]);
      if (!from.used[s]) {
        PyErr_Format(PyExc_ValueError, "slot %lld holds no key", (long long)slots[i]);
        return nullptr;
      }
      ks[i - lo] = from.keys[s];
      hs[i - lo] = hash_of(ks[i - lo]);
      __builtin_prefetch(&t.buckets[t.home_of(hs[i - lo])]);
    }
    for (size_t i = hi; i-- > lo;) {
      const int64_t slot = t.find_hashed(ks[i - lo], hs[i - lo]);
      if (slot >= 0) return Py_BuildValue("nL", Py_ssize_t(i), (long long)slot);
    }
    hi = lo;
  }
  return Py_BuildValue("nL", Py_ssize_t(-1), -1LL);
}

PyObject* kt_held(PyObject* self, PyObject*) {
  const Table& t = table_of(self);
  std::vector<int64_t> out;
  out.reserve(size_t(t.size));
  for (size_t s = 0; s < t.used.size(); ++s) {
    if (t.used[s]) out.push_back(int64_t(s));
  }
  return int64_bytes(out);
}

PyObject* kt_clear(PyObject* self, PyObject*) {
  Table& t = table_of(self);
  std::fill(t.buckets.begin(), t.buckets.end(), 0);
  std::fill(t.used.begin(), t.used.end(), 0);
  t.size = 0;
  ++t.version;
  reinterpret_cast<KeyTableObject*>(self)->memo->forget();
  Py_RETURN_NONE;
}

Py_ssize_t kt_len(PyObject* self) { return table_of(self).size; }

PyMethodDef kt_methods[] = {
    {"find", kt_find, METH_O, "find(keys) -> bytes: int64 per key, its slot or -1"},
    {"find_held", kt_find_held, METH_O,
     "find_held(keys) -> list: (position, slot) of each key held, in order"},
    {"grow", kt_grow, METH_O, "grow(capacity): slots up to a larger capacity, the keys kept"},
    {"distinct", kt_distinct, METH_O | METH_STATIC,
     "distinct(keys) -> bool: whether no key repeats (each checked as check checks it)"},
    {"check", kt_check, METH_O | METH_STATIC,
     "check(keys) -> int: how many keys, each a 16-byte bytes object (else TypeError)"},
    {"insert", kt_insert, METH_VARARGS, "insert(keys, slots): hold each key at its slot"},
    {"remove", kt_remove, METH_O, "remove(slots): drop the keys held at these slots"},
    {"keys_at", kt_keys_at, METH_O, "keys_at(slots) -> list[bytes]: the keys at these slots"},
    {"held", kt_held, METH_NOARGS, "held() -> bytes: int64, every slot holding a key"},
    {"find_last_from", kt_find_last_from, METH_VARARGS,
     "find_last_from(other, slots, end) -> (position, slot): the last of the first end found"},
    {"clear", kt_clear, METH_NOARGS, "clear(): hold no key"},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods kt_as_sequence = {kt_len};

}  // namespace

bool kvci_add_key_table(PyObject* module) {
  KeyTableType.tp_name = "kvci_plugin._C.KeyTable";
  KeyTableType.tp_basicsize = sizeof(KeyTableObject);
  KeyTableType.tp_flags = Py_TPFLAGS_DEFAULT;
  KeyTableType.tp_doc = "KeyTable(capacity): 16-byte page keys -> slots in [0, capacity)";
  KeyTableType.tp_new = kt_new;
  KeyTableType.tp_dealloc = kt_dealloc;
  KeyTableType.tp_methods = kt_methods;
  KeyTableType.tp_as_sequence = &kt_as_sequence;
  if (PyType_Ready(&KeyTableType) < 0) return false;
  Py_INCREF(&KeyTableType);
  if (PyModule_AddObject(module, "KeyTable", reinterpret_cast<PyObject*>(&KeyTableType)) < 0) {
    Py_DECREF(&KeyTableType);
    return false;
  }
  return true;
}
