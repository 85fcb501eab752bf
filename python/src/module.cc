// kvtier._kvtier: the engine API (include/kvtier/kvtier.h) for Python, with pybind11.
//
// Arrays cross without copies: an argument is read through the buffer protocol (numpy) or,
// failing that, DLPack (torch tensors, on the CPU), and the pointer handed to the store or
// the attention kernel is the caller's memory. Every shape, dtype, contiguity and device is
// checked here first, so bad input raises instead of reaching C++ with a wrong extent.
//
// Errors: a non-OK Status raises kvtier.<Code> (a kvtier.Error subclass; InvalidArgument is
// also a ValueError) carrying .code (StatusCodeName) and .message; the binding's own checks
// raise the same classes, InvalidArgument for malformed input and FailedPrecondition for a
// session used after drop(). The GIL is released around every call into the engine; a
// session's calls are serialised by its own mutex (a Session is driven by one thread at a
// time), and a Session keeps its Store alive (the store must outlive its sessions).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/option_table.h"
#include "engine/session_internal.h"
#include "engine/store_sizing.h"
#include "integration/infbench/predictions.h"
#include "integration/infbench/prompt.h"
#include "integration/infbench/score.h"
#include "integration/infbench/task_file.h"
#include "integration/model/llama.h"
#include "integration/model/tasks.h"
#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/scrambled_hot_tier.h"
#include "offload/tiered_store.h"

namespace py = pybind11;

namespace kvtier::python {
namespace {

// ---------------------------------------------------------------------------
// Errors

struct StatusError {
  Status status;
};

constexpr std::array<StatusCode, 11> kErrorCodes = {
    StatusCode::kInvalidArgument,   StatusCode::kNotFound,
    StatusCode::kAlreadyExists,     StatusCode::kFailedPrecondition,
    StatusCode::kResourceExhausted, StatusCode::kCorruption,
    StatusCode::kIOError,           StatusCode::kTimedOut,
    StatusCode::kUnavailable,       StatusCode::kInternal,
    StatusCode::kPermissionDenied};

// The exception classes, by StatusCode (index 0 = the base kvtier.Error). Module-lifetime
// references, created once at import.
std::array<PyObject*, 12> g_error_classes{};

[[noreturn]] void Throw(Status st) { throw StatusError{std::move(st)}; }
void Check(Status st) {
  if (!st.ok()) Throw(std::move(st));
}
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(r).value();
}
[[noreturn]] void Bad(const std::string& message) { Throw(InvalidArgument(message)); }

void RaiseStatus(const Status& st) {
  const int idx = static_cast<int>(st.code());
  PyObject* cls =
      (idx > 0 && idx < static_cast<int>(g_error_classes.size())) ? g_error_classes[idx] : g_error_classes[0];
  py::object exc = py::reinterpret_borrow<py::object>(cls)(py::str(st.ToString()));
  exc.attr("code") = py::str(StatusCodeName(st.code()));
  exc.attr("message") = py::str(st.message());
  PyErr_SetObject(cls, exc.ptr());
}

// ---------------------------------------------------------------------------
// Arrays: buffer protocol or DLPack, read in place

// DLPack's C ABI (dlpack.h v0.x, the layout torch 1.13 and numpy >= 1.22 export).
struct DLDevice {
  int32_t device_type;  // 1 = CPU
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 2 = float, 4 = bfloat, 0 = int
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null = compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

enum class Elem { kF32, kF16, kBF16, kI64, kOther };

const char* ElemName(Elem e) {
  switch (e) {
    case Elem::kF32:
      return "float32";
    case Elem::kF16:
      return "float16";
    case Elem::kBF16:
      return "bfloat16";
    case Elem::kI64:
      return "int64";
    case Elem::kOther:
      break;
  }
  return "an unsupported dtype";
}

Elem ElemOf(DType d) {
  switch (d) {
    case DType::kF32:
      return Elem::kF32;
    case DType::kF16:
      return Elem::kF16;
    case DType::kBF16:
      return Elem::kBF16;
  }
  return Elem::kOther;
}

// A view of a caller's array: data pointer, element type, shape. Holds whatever keeps the
// memory alive (the buffer, or the DLPack capsule's managed tensor) until destroyed.
class ArrayView {
 public:
  ArrayView(py::handle obj, const char* name, bool writable) : name_(name) {
    try {
      if (PyObject_CheckBuffer(obj.ptr())) {
        FromBuffer(obj, writable);
      } else if (py::hasattr(obj, "__dlpack__")) {
        FromDlpack(obj);
      } else {
        Bad(std::string(name) +
            ": expected a numpy array or a torch tensor (buffer protocol or DLPack), got " +
            std::string(py::str(py::type::of(obj).attr("__name__"))));
      }
    } catch (...) {
      Free();  // a throwing constructor runs no destructor
      throw;
    }
  }
  ~ArrayView() { Free(); }
  ArrayView(const ArrayView&) = delete;
  ArrayView& operator=(const ArrayView&) = delete;

  void* data() const { return data_; }
  Elem elem() const { return elem_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_[i]; }

  // Rank and dtype checks with messages naming the argument.
  void Expect(Elem elem, size_t rank) const {
    if (elem_ != elem) Bad(name_ + ": dtype must be " + ElemName(elem) + ", got " + dtype_name_);
    if (shape_.size() != rank)
      Bad(name_ + ": expected " + std::to_string(rank) + " dimensions, got " + std::to_string(shape_.size()) +
          " (shape " + ShapeString() + ")");
  }
  void ExpectDim(size_t i, int64_t want, const char* what) const {
    if (shape_[i] != want)
      Bad(name_ + ": dimension " + std::to_string(i) + " (" + what + ") must be " + std::to_string(want) +
          " (shape " + ShapeString() + ")");
  }
  std::string ShapeString() const {
    std::string s = "[";
    for (size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
    return s + "]";
  }

 private:
  void FromBuffer(py::handle obj, bool writable) {
    const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &buffer_, flags) != 0) {
      PyErr_Clear();
      // Ask again without the requirements, to say which one failed.
      Py_buffer probe;
      if (PyObject_GetBuffer(obj.ptr(), &probe, PyBUF_STRIDES | PyBUF_FORMAT) == 0) {
        const bool ro = probe.readonly;
        PyBuffer_Release(&probe);
        if (writable && ro) Bad(name_ + ": the array is read-only; the output must be writable");
      } else {
        PyErr_Clear();
      }
      Bad(name_ + ": cannot read the buffer");
    }
    has_buffer_ = true;
    data_ = buffer_.buf;
    shape_.assign(buffer_.shape, buffer_.shape + buffer_.ndim);
    elem_ = FormatElem(buffer_.format, buffer_.itemsize);
    dtype_name_ = FormatName(buffer_.format, buffer_.itemsize);
    if (!PyBuffer_IsContiguous(&buffer_, 'C')) Bad(name_ + ": the array must be C-contiguous (row-major)");
  }

  static Elem FormatElem(const char* format, Py_ssize_t itemsize) {
    std::string f = format ? format : "B";
    if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f = f.substr(1);
    if (f == "f" && itemsize == 4) return Elem::kF32;
    if (f == "e" && itemsize == 2) return Elem::kF16;
    if ((f == "q" || f == "l") && itemsize == 8) return Elem::kI64;
    return Elem::kOther;
  }

  // numpy's name of a buffer format: the kind from the struct code, the width from itemsize.
  static std::string FormatName(const char* format, Py_ssize_t itemsize) {
    std::string f = format ? format : "B";
    if (!f.empty() && (f[0] == '<' || f[0] == '>' || f[0] == '=' || f[0] == '@' || f[0] == '!'))
      f = f.substr(1);
    const std::string bits = std::to_string(itemsize * 8);
    if (f == "e" || f == "f" || f == "d" || f == "g") return "float" + bits;
    if (f == "b" || f == "h" || f == "i" || f == "l" || f == "q" || f == "n") return "int" + bits;
    if (f == "B" || f == "H" || f == "I" || f == "L" || f == "Q" || f == "N") return "uint" + bits;
    if (f == "?") return "bool";
    if (f == "Zf" || f == "Zd" || f == "Zg") return "complex" + bits;
    return "buffer format '" + f + "'";
  }

  static std::string DlpackName(const DLDataType& t) {
    const std::string bits = std::to_string(t.bits);
    std::string s;
    switch (t.code) {
      case 0:
        s = "int" + bits;
        break;
      case 1:
        s = "uint" + bits;
        break;
      case 2:
        s = "float" + bits;
        break;
      case 4:
        s = "bfloat" + bits;
        break;
      case 5:
        s = "complex" + bits;
        break;
      case 6:
        s = "bool";
        break;
      default:
        s = "DLPack type code " + std::to_string(t.code) + " of " + bits + " bits";
    }
    if (t.lanes != 1) s += " x" + std::to_string(t.lanes);
    return s;
  }

  // What makes a torch tensor unreadable in place, asked before __dlpack__ so that the message
  // says why instead of torch's own exception escaping: a tensor that requires grad (torch
  // refuses to export it), one on the meta device (no data at all), one in device memory (this
  // binding hands the store host pointers). Objects without these attributes pass.
  void CheckTorchLike(py::handle obj) {
    if (py::hasattr(obj, "requires_grad") && py::bool_(obj.attr("requires_grad")))
      Bad(name_ +
          ": the tensor requires grad; pass tensor.detach() (kvtier reads it in place and records no "
          "gradient)");
    if (!py::hasattr(obj, "device")) return;
    py::object device = obj.attr("device");
    if (!py::hasattr(device, "type")) return;
    const std::string type = py::str(device.attr("type"));
    if (type == "meta")
      Bad(name_ + ": the tensor is on the meta device and has no data to read; create it on the CPU");
    if (type != "cpu")
      Bad(name_ + ": the tensor is on " + std::string(py::str(device)) +
          "; kvtier's Python API reads arrays from host memory, whatever the hot tier: move it with .cpu()");
  }

  void FromDlpack(py::handle obj) {
    CheckTorchLike(obj);
    py::object capsule;
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      Bad(name_ + ": cannot be read in place through DLPack: " + std::string(py::str(e.value())));
    }
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    if (managed == nullptr) {
      PyErr_Clear();
      Bad(name_ + ": __dlpack__ did not return a DLPack capsule");
    }
    // The consumer owns the tensor from here: rename the capsule so its destructor does not
    // free it too, and call the deleter when this view goes away.
    PyCapsule_SetName(capsule.ptr(), "used_dltensor");
    managed_ = managed;
    const DLTensor& t = managed->dl_tensor;
    if (t.device.device_type != 1)
      Bad(name_ + ": the tensor must be on the CPU (DLPack device type " +
          std::to_string(t.device.device_type) + "); kvtier's store and kernels read host memory");
    shape_.assign(t.shape, t.shape + t.ndim);
    dtype_name_ = DlpackName(t.dtype);
    if (t.dtype.lanes != 1)
      elem_ = Elem::kOther;
    else if (t.dtype.code == 2 && t.dtype.bits == 32)
      elem_ = Elem::kF32;
    else if (t.dtype.code == 2 && t.dtype.bits == 16)
      elem_ = Elem::kF16;
    else if (t.dtype.code == 4 && t.dtype.bits == 16)
      elem_ = Elem::kBF16;
    else if (t.dtype.code == 0 && t.dtype.bits == 64)
      elem_ = Elem::kI64;
    else
      elem_ = Elem::kOther;
    data_ = static_cast<char*>(t.data) + t.byte_offset;
    if (t.strides != nullptr) {
      int64_t expect = 1;
      for (int i = t.ndim - 1; i >= 0; --i) {
        if (t.shape[i] != 1 && t.strides[i] != expect)
          Bad(name_ + ": the tensor must be contiguous (row-major); call .contiguous() first");
        expect *= t.shape[i];
      }
    }
  }

  void Free() {
    if (managed_ != nullptr && managed_->deleter != nullptr) managed_->deleter(managed_);
    managed_ = nullptr;
    if (has_buffer_) PyBuffer_Release(&buffer_);
    has_buffer_ = false;
  }

  std::string name_;
  void* data_ = nullptr;
  Elem elem_ = Elem::kOther;
  std::string dtype_name_ = "an unknown dtype";  // the caller's, in numpy's words, for messages
  std::vector<int64_t> shape_;
  Py_buffer buffer_{};
  bool has_buffer_ = false;
  DLManagedTensor* managed_ = nullptr;
};

int CheckedInt(int64_t v, const char* what) {
  if (v < 0 || v > INT32_MAX) Bad(std::string(what) + " out of range (got " + std::to_string(v) + ")");
  return static_cast<int>(v);
}

// ---------------------------------------------------------------------------
// Options from keyword arguments

template <typename T>
T Get(const py::handle& v, const std::string& key) {
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    Bad("option '" + key + "': wrong type (" + std::string(py::str(py::type::of(v).attr("__name__"))) + ")");
  }
}
// Python's bool is an int: refuse True for a count and 1 for a flag, so that a swapped
// argument does not pass silently.
int64_t GetInt(const py::handle& v, const std::string& key) {
  if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr())) Bad("option '" + key + "': expected an int");
  return Get<int64_t>(v, key);
}
bool GetBool(const py::handle& v, const std::string& key) {
  if (!PyBool_Check(v.ptr())) Bad("option '" + key + "': expected a bool");
  return v.cast<bool>();
}

// A keyword argument as its row of the option table (engine/option_table.h) types it; the
// row then checks the range and the choices (SetOption). A wrong Python type is named here.
template <typename Options>
OptionValue PyOptionValue(const OptionDesc<Options>& d, const py::handle& v) {
  const std::string key = d.name;
  switch (d.type) {
    case OptionType::kInt:
    case OptionType::kBytes:
      return GetInt(v, key);
    case OptionType::kBool:
      return GetBool(v, key);
    case OptionType::kDouble:
      if (PyBool_Check(v.ptr())) Bad("option '" + key + "': expected a number");
      return Get<double>(v, key);
    case OptionType::kString:
    case OptionType::kChoice:
      break;
  }
  return Get<std::string>(v, key);
}

// Sets `key` from a keyword argument when `table` has it; false when it does not.
template <typename Options>
bool SetFromKeyword(const std::vector<OptionDesc<Options>>& table, const std::string& key,
                    const py::handle& v, Options* o) {
  const OptionDesc<Options>* d = FindOption(table, key);
  if (d == nullptr) return false;
  Check(SetOption(*d, o, PyOptionValue(*d, v)));
  return true;
}

py::object PyValue(const OptionValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return py::int_(*i);
  if (const auto* b = std::get_if<bool>(&v)) return py::bool_(*b);
  if (const auto* d = std::get_if<double>(&v)) return py::float_(*d);
  return py::str(std::get<std::string>(v));
}

template <typename Options>
void AddToDict(const std::vector<OptionDesc<Options>>& table, const Options& o, py::dict* d) {
  for (const auto& row : table) (*d)[row.name] = PyValue(row.get(o));
}

StoreOptions StoreOptionsFrom(const py::kwargs& kw) {
  StoreOptions o;
  for (auto item : kw) {
    const std::string key = py::str(item.first);
    if (!SetFromKeyword(StoreOptionTable(), key, item.second, &o)) Bad("Store: unknown option '" + key + "'");
  }
  return o;
}

SessionOptions SessionOptionsFrom(const py::kwargs& kw) {
  SessionOptions o;
  // The preset first, so that probe/alloc/index/budget_tokens given with it override its parts.
  if (kw.contains("preset")) {
    const RetrievalPreset p = Take(MakeRetrievalPreset(Get<std::string>(kw["preset"], "preset")));
    o.retrieval = p.retrieval;
  }
  for (auto item : kw) {
    const std::string key = py::str(item.first);
    py::handle v = item.second;
    if (key == "preset") continue;
    if (key == "retrieval") {
      o.retrieval = Take(RetrieverOptions::Parse(Get<std::string>(v, key)));
    } else if (!SetFromKeyword(SessionOptionTable(), key, v, &o) &&
               !SetFromKeyword(RetrieverOptionTable(), key, v, &o.retrieval)) {
      Bad("Session: unknown option '" + key + "'");
    }
  }
  Check(o.Validate());
  return o;
}

// Store.options: what the store was opened with, the remote spec's password replaced by
// "***" (RedactRemoteSpec): the dict is for reading and printing, and a password there
// would end up in a log.
py::dict StoreOptionsDict(const StoreOptions& o) {
  py::dict d;
  AddToDict(StoreOptionTable(), o, &d);
  d["remote"] = py::str(RedactRemoteSpec(o.remote));
  return d;
}

// The option table's rows of one struct, as the stubs test reads them.
template <typename Options>
void AddRows(const char* owner, const std::vector<OptionDesc<Options>>& table, const Options& defaults,
             py::list* out) {
  for (const auto& row : table) {
    py::dict d;
    d["struct"] = owner;
    d["name"] = row.name;
    d["flag"] = row.flag;
    d["type"] = OptionTypeName(row.type);
    d["default"] = PyValue(row.get(defaults));
    d["meaning"] = row.meaning;
    d["lo"] = row.lo;
    d["hi"] = row.hi;
    d["dlo"] = row.dlo;
    d["dhi"] = row.dhi;
    d["dlo_open"] = row.dlo_open;
    d["choices"] = row.choices;
    out->append(d);
  }
}

// One line per row: "name (type, default X): meaning".
template <typename Options>
std::string OptionsDoc(const std::vector<OptionDesc<Options>>& table, const Options& defaults) {
  std::string out;
  for (const auto& row : table)
    out += std::string(row.name) + " (" + OptionTypeName(row.type) + ", default '" +
           FormatOptionValue(row.get(defaults)) + "'): " + row.meaning + "\n";
  return out;
}

py::list OptionTableRows() {
  py::list out;
  AddRows("StoreOptions", StoreOptionTable(), StoreOptions{}, &out);
  const SessionOptions session;
  AddRows("SessionOptions", RetrieverOptionTable(), session.retrieval, &out);
  AddRows("SessionOptions", SessionOptionTable(), session, &out);
  return out;
}

py::dict StatsDict(const AttendStats& s) {
  py::dict d;
  d["probe_ms"] = s.probe_ms;
  d["search_ms"] = s.search_ms;
  d["alloc_ms"] = s.alloc_ms;
  d["fetch_ms"] = s.fetch_ms;
  d["attention_ms"] = s.attention_ms;
  d["entropy"] = s.entropy;
  d["chunks"] = s.chunks;
  d["chunks_clipped"] = s.chunks_clipped;
  d["reused"] = s.reused;
  d["sliced"] = s.sliced;
  d["first_stage_bytes"] = s.first_stage_bytes;
  d["rescoring_bytes"] = s.rescoring_bytes;
  d["attention_bytes"] = s.attention_bytes;
  return d;
}

// ---------------------------------------------------------------------------
// Store and Session

class PySession;

// A Store, until close(): then every call raises FailedPrecondition, and so does every call of
// its sessions (their Session objects are destroyed first, as the engine requires).
//
// Closing while other threads use the store: calls that run with the GIL released (Open,
// Attach, WaitForDurable) hold a Use, and close() waits for them; calls that hold the GIL see
// either the open store or the closed one. Sessions are ended under their own mutex, so an
// append or attend in flight finishes first.
class PyStore {
 public:
  explicit PyStore(const py::kwargs& kw) : PyStore(StoreOptionsFrom(kw)) {}
  explicit PyStore(const StoreOptions& o, const StoreHooks& hooks = StoreHooks{}) {
    py::gil_scoped_release nogil;
    store_ = Take(TieredStore::Open(o, hooks));
  }
  // GIL held.
  TieredStore* get() const {
    if (!store_) Throw(FailedPrecondition("the store was closed"));
    return store_.get();
  }
  bool closed() const { return !store_; }

  // Marks a call that releases the GIL while it uses the store; made with the GIL held.
  class Use {
   public:
    explicit Use(PyStore& s) : s_(s) {
      s_.get();  // raises once closed
      if (s_.closing_) Throw(FailedPrecondition("the store is being closed"));
      s_.busy_.fetch_add(1);
    }
    ~Use() { s_.busy_.fetch_sub(1); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    PyStore& s_;
  };

  void Register(const std::shared_ptr<PySession>& s) {  // GIL held
    std::erase_if(sessions_, [](const std::weak_ptr<PySession>& w) { return w.expired(); });
    sessions_.push_back(s);
  }

  void Close();  // below PySession

  py::dict Counters() const {
    const StoreCounters c = get()->counters();
    py::dict d;
    d["hot_chunks"] = c.hot_chunks;
    d["hot_bytes"] = c.hot_bytes;
    d["warm_chunks"] = c.warm_chunks;
    d["warm_bytes"] = c.warm_bytes;
    d["cold_chunks"] = c.cold_chunks;
    d["cold_bytes"] = c.cold_bytes;
    d["promotions"] = c.promotions;
    d["demotions"] = c.demotions;
    d["hits"] = c.hits;
    d["misses"] = c.misses;
    d["bytes_moved"] = c.bytes_moved;
    d["cold_writes"] = c.cold_writes;
    d["cold_reads"] = c.cold_reads;
    d["lease_expired"] = c.lease_expired;
    d["pin_waits"] = c.pin_waits;
    d["pin_wait_us"] = c.pin_wait_us;
    d["pin_wait_timeouts"] = c.pin_wait_timeouts;
    d["hot_reserved"] = c.hot_reserved;
    d["chunks_sealed"] = c.chunks_sealed;
    d["chunks_landing"] = c.chunks_landing;
    d["dropped_chunks"] = c.dropped_chunks;
    return d;
  }
  std::vector<SequenceId> Sequences() const { return get()->ListSequences(); }
  int64_t Length(SequenceId seq, int layer) const { return Take(get()->SequenceLength(seq, layer)); }
  uint64_t ChunkCount(SequenceId seq, int layer) const { return Take(get()->ChunkCount(seq, layer)); }
  void WaitForDurable() {
    Use use(*this);
    TieredStore* st = get();
    py::gil_scoped_release nogil;
    Check(st->WaitForDurable());
  }

 private:
  std::unique_ptr<TieredStore> store_;
  std::atomic<int> busy_{0};
  bool closing_ = false;
  std::vector<std::weak_ptr<PySession>> sessions_;  // GIL held to read or change
};

StepKind ParseStep(const std::string& s) {
  if (s == "prefill") return StepKind::kPrefill;
  if (s == "decode") return StepKind::kDecode;
  Bad("begin_step: kind must be 'prefill' or 'decode' (got '" + s + "')");
}

class PySession {
 public:
  PySession(py::object store, std::unique_ptr<Session> s)
      : store_(std::move(store)), session_(std::move(s)) {}

  static std::shared_ptr<PySession> Open(py::object store, const py::kwargs& kw) {
    PyStore& ps = store.cast<PyStore&>();
    SessionOptions o = SessionOptionsFrom(kw);
    PyStore::Use use(ps);
    TieredStore* st = ps.get();
    std::unique_ptr<Session> s;
    {
      py::gil_scoped_release nogil;
      s = Take(Session::Open(st, o));
    }
    auto r = std::make_shared<PySession>(std::move(store), std::move(s));
    ps.Register(r);
    return r;
  }
  static std::shared_ptr<PySession> Attach(py::object store, SequenceId seq, const py::kwargs& kw) {
    PyStore& ps = store.cast<PyStore&>();
    SessionOptions o = SessionOptionsFrom(kw);
    PyStore::Use use(ps);
    TieredStore* st = ps.get();
    std::unique_ptr<Session> s;
    {
      py::gil_scoped_release nogil;
      s = Take(Session::Attach(st, seq, o));
    }
    auto r = std::make_shared<PySession>(std::move(store), std::move(s));
    ps.Register(r);
    return r;
  }

  Session& s() const {
    if (!session_) Throw(FailedPrecondition(ended_));
    return *session_;
  }

  // Store.close(): destroys the Session (the sequence stays as it is, unclosed) once no call
  // of this session is in flight. GIL held on entry and on return; session_ changes with both
  // the GIL and mu_ held, so a reader holding either sees it whole.
  void EndForStoreClose() {
    std::unique_ptr<Session> dead;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      {
        py::gil_scoped_acquire gil;
        dead = std::move(session_);
        if (dead) ended_ = "the store was closed (Store.close(), or the end of its with block)";
      }
      dead.reset();
    }
  }

  // The context manager's exit: closes the sequence unless it was closed, dropped or ended.
  void Exit() {
    if (!session_ || closed_) return;
    Close();
  }
  const Geometry& g() const { return s().geometry(); }

  void CheckLayer(int64_t layer) const {
    if (layer < 0 || layer >= g().layers)
      Bad("layer " + std::to_string(layer) + " out of range [0, " + std::to_string(g().layers) + ")");
  }

  void Append(int64_t layer, py::handle k, py::handle v) {
    CheckLayer(layer);
    const Geometry& geo = g();
    ArrayView kv(k, "k", false), vv(v, "v", false);
    for (const ArrayView* a : {&kv, &vv}) {
      a->Expect(ElemOf(geo.dtype), 3);
      a->ExpectDim(1, geo.kv_heads, "kv_heads");
      a->ExpectDim(2, geo.head_dim, "head_dim");
    }
    if (kv.dim(0) != vv.dim(0))
      Bad("k and v must hold the same number of tokens (" + kv.ShapeString() + " vs " + vv.ShapeString() +
          ")");
    const int n = CheckedInt(kv.dim(0), "tokens");
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().Append(static_cast<int>(layer), kv.data(), vv.data(), n, geo.dtype));
  }

  void BeginStep(const std::string& kind) {
    const StepKind k = ParseStep(kind);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().BeginStep(k));
  }

  // q [m, q_heads, head_dim] f32 and positions [m] int64 (or the first position as an int).
  struct Queries {
    std::unique_ptr<ArrayView> q, pos;
    std::vector<int64_t> own_pos;
    const int64_t* positions = nullptr;
    int m = 0;
  };
  Queries ReadQueries(py::handle q, py::handle positions) const {
    Queries r;
    r.q = std::make_unique<ArrayView>(q, "q", false);
    r.q->Expect(Elem::kF32, 3);
    r.q->ExpectDim(1, g().q_heads, "q_heads");
    r.q->ExpectDim(2, g().head_dim, "head_dim");
    r.m = CheckedInt(r.q->dim(0), "queries");
    if (PyLong_Check(positions.ptr()) && !PyBool_Check(positions.ptr())) {
      const int64_t first = positions.cast<int64_t>();
      if (first < 0) Bad("positions: the first position must be >= 0 (got " + std::to_string(first) + ")");
      r.own_pos.resize(static_cast<size_t>(r.m));
      for (int i = 0; i < r.m; ++i) r.own_pos[static_cast<size_t>(i)] = first + i;
      r.positions = r.own_pos.data();
    } else {
      r.pos = std::make_unique<ArrayView>(positions, "positions", false);
      r.pos->Expect(Elem::kI64, 1);
      r.pos->ExpectDim(0, r.m, "one per query");
      r.positions = static_cast<const int64_t*>(r.pos->data());
    }
    return r;
  }

  py::dict Attend(int64_t layer, py::handle q, py::handle positions, py::handle out) {
    CheckLayer(layer);
    Queries qs = ReadQueries(q, positions);
    ArrayView ov(out, "out", true);
    ov.Expect(Elem::kF32, 3);
    ov.ExpectDim(0, qs.m, "queries");
    ov.ExpectDim(1, g().q_heads, "q_heads");
    ov.ExpectDim(2, g().head_dim, "head_dim");
    const auto* qp = static_cast<const char*>(qs.q->data());
    const auto* op = static_cast<const char*>(ov.data());
    const size_t bytes = static_cast<size_t>(qs.m) * g().q_heads * g().head_dim * sizeof(float);
    if (qp < op + bytes && op < qp + bytes) Bad("out must not overlap q");
    AttendStats stats;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      Check(s().Attend(static_cast<int>(layer), static_cast<const float*>(qs.q->data()), qs.positions, qs.m,
                       static_cast<float*>(ov.data()), &stats));
    }
    return StatsDict(stats);
  }

  void Observe(int64_t layer, py::handle q, py::handle positions) {
    CheckLayer(layer);
    Queries qs = ReadQueries(q, positions);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().Observe(static_cast<int>(layer), static_cast<const float*>(qs.q->data()), qs.positions, qs.m));
  }

  void SetQuestion(int64_t layer, py::handle q) {
    CheckLayer(layer);
    ArrayView qv(q, "q", false);
    qv.Expect(Elem::kF32, 3);
    qv.ExpectDim(1, g().q_heads, "q_heads");
    qv.ExpectDim(2, g().head_dim, "head_dim");
    const int m = CheckedInt(qv.dim(0), "queries");
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().SetQuestion(static_cast<int>(layer), static_cast<const float*>(qv.data()), m));
  }

  // Gather: which spans a layer attends. The spans stay valid only while pinned and until the
  // next Append, which Python cannot enforce on a view, so their K/V are copied out (as
  // numpy arrays of the storage dtype; bf16 as uint16 bit patterns) and the pins released.
  // The spans point into the store's hot tier, which may be device memory (device cuda)
  // or any tier whose bytes the host cannot read in place, so the copies go through the
  // tier's Download (for "host" the same memcpy as before); a failed copy raises its Status.
  py::dict Gather(int64_t layer, py::handle q, py::handle positions) {
    CheckLayer(layer);
    Queries qs = ReadQueries(q, positions);
    const Geometry geo = g();
    // mu_ stays held until the pins are back and the copies made: Store.close() waits for it
    // before it destroys the session and the tier the spans point into.
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    HotTier* tier = nullptr;
    std::optional<LayerParts> parts;
    {
      py::gil_scoped_release nogil;
      lock.lock();
      tier = ImplOf(s()).store()->hot_tier();
      parts = Take(ImplOf(s()).Gather(static_cast<int>(layer), static_cast<const float*>(qs.q->data()),
                                      qs.positions, qs.m));
    }
    // The pins go back however this returns (a failed Download or allocation throws).
    struct Unpin {
      std::optional<LayerParts>& p;
      ~Unpin() { p->Release(); }
    } unpin{parts};
    py::module_ np = py::module_::import("numpy");
    py::object dt = np.attr(geo.dtype == DType::kF32   ? "float32"
                            : geo.dtype == DType::kF16 ? "float16"
                                                       : "uint16");
    const size_t tok_bytes = geo.token_elems() * DTypeSize(geo.dtype);
    py::list list;
    for (size_t i = 0; i < parts->parts.size(); ++i) {
      const kernels::KvSpan& sp = parts->parts[i];
      py::dict d;
      auto copy = [&](const void* src) {
        py::array a(py::dtype::from_args(dt),
                    std::vector<py::ssize_t>{sp.n_tokens, geo.kv_heads, geo.head_dim});
        if (sp.n_tokens > 0) {
          void* dst = a.mutable_data();
          Status st;
          {
            py::gil_scoped_release nogil;
            st = tier->Download(dst, static_cast<const uint8_t*>(src),
                                static_cast<size_t>(sp.n_tokens) * tok_bytes);
          }
          Check(std::move(st));
        }
        return a;
      };
      d["k"] = copy(sp.k);
      d["v"] = copy(sp.v);
      d["first_position"] = sp.first_position;
      d["rope_position"] = i < parts->rope_positions.size() ? parts->rope_positions[i] : -1;
      d["kind"] = i == 0 ? "sinks" : (i <= parts->n_chunks ? "chunk" : "local");
      list.append(d);
    }
    py::dict r;
    r["parts"] = list;
    r["chunks"] = parts->chunks;
    r["local_start"] = parts->local_start;
    r["stats"] = StatsDict(parts->stats);
    return r;
  }

  py::dict Compress(const std::string& policy, int64_t kv_budget, int64_t n_queries) {
    if (n_queries < 0 || n_queries > INT32_MAX) Bad("n_queries out of range");
    CompressReport rep;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      rep = Take(s().Compress(policy, kv_budget, static_cast<int>(n_queries)));
    }
    py::dict d;
    d["policy"] = rep.policy;
    d["dropped_chunks"] = rep.dropped_chunks;
    d["kept_tokens"] = rep.kept_tokens;
    d["compress_every"] = rep.compress_every;
    return d;
  }

  void Close() {
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      Check(s().Close());
    }
    closed_ = true;
  }
  void Drop() {
    std::unique_ptr<Session> dead;
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().Drop());
    {
      py::gil_scoped_acquire gil;
      dead = std::move(session_);
      ended_ = "the session was dropped";
    }
  }

  py::dict Counters() const {
    const SessionCounters c = s().counters();
    py::dict d;
    d["steps"] = c.steps;
    d["attends"] = c.attends;
    d["tokens_appended"] = c.tokens_appended;
    d["chunks_attended"] = c.chunks_attended;
    d["max_layer_chunks"] = c.max_layer_chunks;
    d["compressions"] = c.compressions;
    d["dropped_chunks"] = c.dropped_chunks;
    d["chunks_clipped"] = c.chunks_clipped;
    d["selections_reused"] = c.selections_reused;
    d["selections_sliced"] = c.selections_sliced;
    d["first_stage_bytes"] = c.first_stage_bytes;
    d["rescoring_bytes"] = c.rescoring_bytes;
    d["attention_bytes"] = c.attention_bytes;
    d["probe_ms"] = c.probe_ms;
    d["search_ms"] = c.search_ms;
    d["alloc_ms"] = c.alloc_ms;
    d["fetch_ms"] = c.fetch_ms;
    d["attention_ms"] = c.attention_ms;
    d["host_syncs"] = c.host_syncs;
    return d;
  }

  py::dict Options() const {
    const SessionOptions& o = s().options();
    py::dict d;
    AddToDict(SessionOptionTable(), o, &d);
    AddToDict(RetrieverOptionTable(), o.retrieval, &d);
    d["retrieval"] = o.retrieval.ToString();
    return d;
  }

  SequenceId Sequence() const { return s().sequence(); }
  std::vector<std::vector<uint64_t>> LastChunks() const { return s().last_chunks(); }
  const py::object& store() const { return store_; }

 private:
  py::object store_;  // keeps the PyStore alive for as long as this session
  std::unique_ptr<Session> session_;
  std::string ended_;    // why session_ is null: dropped, or the store closed
  bool closed_ = false;  // close() succeeded (the context manager's exit does not close twice)
  std::mutex mu_;
};

void PyStore::Close() {
  if (!store_ || closing_) return;  // a second close() is a no-op
  closing_ = true;
  // No new Use starts from here (get() still answers until store_ goes, so wait for the ones
  // in flight: an Open that finishes registers its session before its Use ends).
  {
    py::gil_scoped_release nogil;
    while (busy_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<std::shared_ptr<PySession>> live;
  for (const auto& w : sessions_)
    if (auto p = w.lock()) live.push_back(std::move(p));
  sessions_.clear();
  for (const auto& p : live) p->EndForStoreClose();
  std::unique_ptr<TieredStore> dead = std::move(store_);
  closing_ = false;
  py::gil_scoped_release nogil;
  dead.reset();
}

// The shipped model's C++ forward pass (integration/model/llama.h) with the store `kvtier
// infinite` gives it: the C++ path the Python one is timed against in the same process
// (kvtier.tools.decode_bench). Tokens are bytes; logits come back as a list.
class PyLlama {
 public:
  PyLlama(const std::string& weights, int64_t context, const std::string& preset, int budget, int n_sink,
          int n_local, int chunk_size) {
    py::gil_scoped_release nogil;
    model_ = Take(model::LlamaModel::Load(weights));
    const RetrievalPreset p = Take(MakeRetrievalPreset(preset));
    StoreOptions so;
    so.geometry = model_->config().KvGeometry(DType::kF32);
    so.n_sink = n_sink;
    so.n_local = n_local;
    so.chunk_size = chunk_size;
    so.repr_topk = p.repr_topk > 0 ? std::min(p.repr_topk, chunk_size) : chunk_size;
    so.transfer_threads = 2;
    // kvtier infinite's sizing: every chunk in warm, what one layer attends in hot.
    const StoreSize size = SizeStoreForContext(so, context, budget, /*retrieve=*/true);
    so.warm_bytes = size.warm_bytes;
    so.hot_bytes = size.hot_bytes;
    session_ = Take(model::LlamaSession::Create(model_.get(), so, PositionMode::kInfLLM));
    RetrieverOptions r = p.retrieval;
    r.budget_tokens = budget;
    Check(session_->EnableRetrieval(r));
  }
  std::vector<float> Prefill(const py::bytes& tokens, int window) {
    std::vector<int32_t> t;
    for (char c : std::string(tokens)) t.push_back(static_cast<unsigned char>(c));
    py::gil_scoped_release nogil;
    std::vector<float> logits = Take(session_->Prefill(t, window));
    const size_t vocab = static_cast<size_t>(model_->config().vocab);
    return std::vector<float>(logits.end() - static_cast<std::ptrdiff_t>(vocab), logits.end());
  }
  std::vector<float> Decode(int token) {
    py::gil_scoped_release nogil;
    return Take(session_->Decode(token));
  }
  int64_t Position() const { return session_->position(); }

 private:
  std::unique_ptr<model::LlamaModel> model_;
  std::unique_ptr<model::LlamaSession> session_;
};

// Text from C++ (UTF-8 that a model's bytes may have broken) as a Python str, bad bytes replaced.
py::str Utf8(const std::string& s) {
  return py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

py::dict InfBenchSampleDict(const infbench::BenchSample& b) {
  py::dict d;
  d["id"] = b.id_json;
  d["context"] = Utf8(b.context);
  d["input"] = Utf8(b.input);
  d["answer"] = b.answer_json;
  d["options"] = b.options;
  d["max_new_tokens"] = b.max_new_tokens;
  d["line"] = b.line;
  return d;
}

infbench::BenchSample InfBenchSampleFrom(const py::dict& d) {
  infbench::BenchSample b;
  try {
    b.id_json = d.contains("id") ? d["id"].cast<std::string>() : "0";
    b.context = d["context"].cast<std::string>();
    b.input = d.contains("input") ? d["input"].cast<std::string>() : "";
    b.answer_json = d.contains("answer") ? d["answer"].cast<std::string>() : "null";
    if (d.contains("options")) b.options = d["options"].cast<std::vector<std::string>>();
    if (d.contains("max_new_tokens")) b.max_new_tokens = d["max_new_tokens"].cast<int>();
    if (d.contains("line")) b.line = d["line"].cast<int>();
  } catch (const py::cast_error& e) {
    Bad(std::string("a ∞-Bench sample is a dict of id, context, input, answer (JSON text), options, "
                    "max_new_tokens and line, as infbench_read returns it: ") +
        e.what());
  } catch (const py::error_already_set&) {
    Bad("a ∞-Bench sample needs a 'context' (a dict as infbench_read returns it)");
  }
  return b;
}

py::dict InfBenchPredictionDict(const infbench::Prediction& p) {
  py::dict d;
  d["id"] = p.id_json;
  d["prediction"] = Utf8(p.prediction);
  d["ground_truth"] = p.ground_truth_json;
  return d;
}

}  // namespace
}  // namespace kvtier::python

PYBIND11_MODULE(_kvtier, m) {
  using namespace kvtier;
  using namespace kvtier::python;
  m.doc() = "kvtier engine API (see include/kvtier/session.h); use the kvtier package";

  // kvtier.Error and one subclass per StatusCode.
  PyObject* base = PyErr_NewExceptionWithDoc(
      "kvtier.Error", "A kvtier Status that is not OK: .code, .message.", PyExc_Exception, nullptr);
  g_error_classes[0] = base;
  m.attr("Error") = py::handle(base);
  for (StatusCode code : kErrorCodes) {
    const std::string name = StatusCodeName(code);
    py::tuple bases = code == StatusCode::kInvalidArgument
                          ? py::tuple(py::make_tuple(py::handle(base), py::handle(PyExc_ValueError)))
                          : py::tuple(py::make_tuple(py::handle(base)));
    PyObject* cls = PyErr_NewException(("kvtier." + name).c_str(), bases.ptr(), nullptr);
    g_error_classes[static_cast<size_t>(code)] = cls;
    m.attr(name.c_str()) = py::handle(cls);
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      RaiseStatus(e.status);
    } catch (const std::bad_alloc&) {
      RaiseStatus(ResourceExhausted("out of memory"));
    }
  });

  m.def("version", &Version, "The C++ library's version.");
  m.def(
      "size_store",
      [](int64_t context, int budget_tokens, bool retrieve, const py::kwargs& kw) {
        if (context < 0) Bad("size_store: context must be >= 0 (got " + std::to_string(context) + ")");
        const StoreSize size = SizeStoreForContext(StoreOptionsFrom(kw), context, budget_tokens, retrieve);
        py::dict d;
        d["hot_bytes"] = size.hot_bytes;
        d["warm_bytes"] = size.warm_bytes;
        return d;
      },
      py::arg("context"), py::arg("budget_tokens"), py::arg("retrieve") = true,
      "Tier sizes for one sequence of up to `context` tokens (engine/store_sizing.h, as `kvtier infinite` "
      "sizes its store): {'hot_bytes', 'warm_bytes'}. The keyword arguments are Store options (geometry, "
      "dtype, chunk_size); the warm tier holds every chunk, the hot pool what one layer may attend.");
  m.def("option_table", &OptionTableRows,
        "The engine option table (engine/option_table.h): one dict per Store and Session keyword argument "
        "(struct, name, flag, type, default, meaning, lo, hi, choices).");
  m.def(
      "_scrambled_store",
      [](const py::kwargs& kw) {
        StoreOptions o = StoreOptionsFrom(kw);
        StoreHooks hooks;
        hooks.hot_tier_factory = [](size_t pool, size_t slot) -> Result<std::unique_ptr<HotTier>> {
          KVTIER_ASSIGN_OR_RETURN(auto inner, MakeHotTier(Device::kCpu, pool, slot));
          // Bytes at rest are the caller's XOR 0x5A, like device memory the host cannot read in
          // place; only its copies translate. It reports device kCpu so that sessions open with
          // the CPU attention backend in any build: Gather must hand back the appended bytes
          // through it, which a host memcpy of the spans would not (tests/python/test_api.py).
          return std::unique_ptr<HotTier>(new XorScrambledHotTier(std::move(inner), Device::kCpu));
        };
        return std::make_unique<PyStore>(o, hooks);
      },
      "Tests only: Store(**options) over a hot tier whose stored bytes are XOR-scrambled (read through its "
      "Download), to check that nothing reads hot memory in place.");
  // The prompts of `kvtier infinite` (integration/model/tasks.h), drawn in the same order from
  // the same generator, so that a Python runner evaluates exactly the same samples.
  m.def(
      "make_samples",
      [](const std::string& task, int64_t context, int64_t samples, int64_t seed) {
        Check(model::CheckTask(task));
        if (samples < 0) Bad("samples must be >= 0 (got " + std::to_string(samples) + ")");
        if (seed < 0) Bad("seed must be >= 0 (got " + std::to_string(seed) + ")");
        std::mt19937_64 rng = model::SampleRng(seed, context);
        py::list out;
        for (int64_t i = 0; i < samples; ++i) {
          model::Sample s = Take(model::MakeSample(task, context, rng));
          py::dict d;
          d["prompt"] = py::bytes(s.prompt);
          d["answer"] = py::bytes(s.answer);
          d["needle_begin"] = s.needle_begin;
          d["needle_end"] = s.needle_end;
          d["answer_begin"] = s.answer_begin;
          d["answer_end"] = s.answer_end;
          out.append(d);
        }
        return out;
      },
      py::arg("task"), py::arg("context"), py::arg("samples"), py::arg("seed") = 1,
      "kvtier infinite's samples: [{prompt, answer (bytes), needle_begin, needle_end, answer_begin, "
      "answer_end}].");
  // ∞-Bench's task files, prompts, truncation, scoring and predictions (integration/infbench/):
  // the same code as `kvtier infinite --data`, for kvtier.tools.infinitebench.
  m.def(
      "infbench_read",
      [](const std::string& path) {
        py::list files;
        for (const infbench::TaskFile& f : Take(infbench::ReadTaskData(path))) {
          py::list samples;
          for (const infbench::BenchSample& b : f.samples) samples.append(InfBenchSampleDict(b));
          py::dict d;
          d["task"] = f.task;
          d["path"] = f.path;
          d["samples"] = samples;
          files.append(d);
        }
        return files;
      },
      py::arg("path"),
      "A ∞-Bench task file or a folder of <task>.jsonl: [{task, path, samples: [{id (JSON text), context, "
      "input, answer (JSON text), options, max_new_tokens, line}]}].");
  m.def(
      "infbench_prompt",
      [](const std::string& family, const std::string& task, const py::dict& sample) {
        return Utf8(Take(infbench::BuildPrompt(family, task, InfBenchSampleFrom(sample))));
      },
      py::arg("family"), py::arg("task"), py::arg("sample"),
      "The benchmark's prompt of a sample (template family kvtier | gpt4 | yarn-mistral), before "
      "truncation.");
  m.def(
      "infbench_ground_truth",
      [](const std::string& task, const py::dict& sample) {
        return Take(infbench::GroundTruthJson(task, InfBenchSampleFrom(sample)));
      },
      py::arg("task"), py::arg("sample"), "What the benchmark's scorer compares with (JSON text).");
  m.def(
      "infbench_score",
      [](const std::string& task, const std::string& prediction, const std::string& ground_truth,
         const std::string& family) {
        return Take(infbench::ScoreOne(task, prediction, ground_truth, family));
      },
      py::arg("task"), py::arg("prediction"), py::arg("ground_truth"), py::arg("family") = "",
      "One prediction's score in [0, 1] by the benchmark's rule for the task.");
  m.def("infbench_rouge_lsum", &infbench::RougeLsum, py::arg("prediction"), py::arg("reference"),
        "ROUGE-Lsum F as rouge_score computes it.");
  m.def(
      "infbench_truncate",
      [](const std::vector<int64_t>& tokens, int64_t max_len) {
        if (max_len < 0) Bad("max_len must be >= 0 (got " + std::to_string(max_len) + ")");
        return infbench::TruncateMiddle(tokens, static_cast<size_t>(max_len));
      },
      py::arg("tokens"), py::arg("max_len"),
      "The benchmark's truncation: the first n // 2 and the last n - n // 2.");
  m.def(
      "infbench_max_new_tokens",
      [](const std::string& task) {
        Check(infbench::CheckTaskName(task));
        return infbench::DefaultMaxNewTokens(task);
      },
      py::arg("task"), "The benchmark's generation budget for a task, in tokens.");
  py::class_<infbench::PredictionsFile>(m, "InfBenchPredictions",
                                        "A method's predictions on one task (preds_<task>.jsonl), resumable.")
      .def(py::init([](const std::string& path) { return Take(infbench::PredictionsFile::Open(path)); }),
           py::arg("path"))
      .def(
          "find",
          [](const infbench::PredictionsFile& f, const std::string& id) -> py::object {
            const infbench::Prediction* p = f.Find(id);
            if (p == nullptr) return py::none();
            return InfBenchPredictionDict(*p);
          },
          py::arg("id"), "The prediction of sample `id` (JSON text) already in the file, or None.")
      .def(
          "append",
          [](infbench::PredictionsFile& f, const std::string& id, const std::string& prediction,
             const std::string& ground_truth) {
            Check(f.Append({id, prediction, ground_truth}));
          },
          py::arg("id"), py::arg("prediction"), py::arg("ground_truth"), "Appends one line and flushes it.")
      .def_property_readonly("predictions",
                             [](const infbench::PredictionsFile& f) {
                               py::list out;
                               for (const infbench::Prediction& p : f.predictions())
                                 out.append(InfBenchPredictionDict(p));
                               return out;
                             })
      .def_property_readonly("dropped_partial_lines", &infbench::PredictionsFile::dropped_partial_lines)
      .def_property_readonly("path", &infbench::PredictionsFile::path);
  m.def("preset_names", &RetrievalPresetNames, "Retrieval preset names, the default first.");
  m.def(
      "preset",
      [](const std::string& name) {
        const RetrievalPreset p = Take(MakeRetrievalPreset(name));
        py::dict d;
        d["retrieval"] = p.retrieval.ToString();
        d["probe"] = p.retrieval.probe;
        d["alloc"] = p.retrieval.alloc;
        d["index"] = p.retrieval.index;
        d["budget_tokens"] = p.retrieval.budget_tokens;
        d["repr_topk"] = p.repr_topk;
        return d;
      },
      py::arg("name"), "A retrieval preset's options as a dict.");

  py::class_<PyLlama>(m, "CppLlama",
                      "The shipped model's C++ forward over a kvtier store (InfLLM positions, "
                      "retrieval by preset), for same-process timing against transformers.")
      .def(py::init<const std::string&, int64_t, const std::string&, int, int, int, int>(),
           py::arg("weights"), py::arg("context"), py::arg("preset") = "kvtier", py::arg("budget") = 256,
           py::arg("n_sink") = 16, py::arg("n_local") = 256, py::arg("chunk_size") = 32)
      .def("prefill", &PyLlama::Prefill, py::arg("tokens"), py::arg("window") = 64,
           "Runs the bytes in windows; returns the last token's logits.")
      .def("decode", &PyLlama::Decode, py::arg("token"), "One token; returns its logits.")
      .def_property_readonly("position", &PyLlama::Position);

  // The keyword arguments' docstrings, from the option table.
  static const std::string store_doc =
      "Store(**options): StoreOptions as keyword arguments; unknown or invalid options raise "
      "kvtier.InvalidArgument.\n\n" +
      OptionsDoc(StoreOptionTable(), StoreOptions{});
  static const std::string session_doc =
      "Session.open(store, **options): a new sequence. Options: preset (a retrieval preset, applied first), "
      "retrieval (a whole RetrieverOptions spec string), and SessionOptions as keyword arguments:\n\n" +
      OptionsDoc(RetrieverOptionTable(), SessionOptions{}.retrieval) +
      OptionsDoc(SessionOptionTable(), SessionOptions{});
  py::class_<PyStore>(m, "Store",
                      "The tiers shared by every sequence: Store::Open(StoreOptions). A context "
                      "manager: `with kvtier.Store(...) as store:` closes it at the end of the block.")
      .def(py::init<const py::kwargs&>(), store_doc.c_str())
      .def_property_readonly("options", [](const PyStore& s) { return StoreOptionsDict(s.get()->options()); })
      .def_property_readonly("closed", &PyStore::closed, "True after close().")
      .def(
          "close", &PyStore::Close,
          "Ends the store's sessions (their sequences are left as they are: close a session first to persist "
          "it) and releases the tiers. Every later call on the store or its sessions raises "
          "kvtier.FailedPrecondition; a second close() does nothing.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyStore& s, const py::args&) { s.Close(); })
      .def("counters", &PyStore::Counters, "StoreCounters as a dict (a consistent snapshot).")
      .def("sequences", &PyStore::Sequences)
      .def("sequence_length", &PyStore::Length, py::arg("sequence"), py::arg("layer"))
      .def("chunk_count", &PyStore::ChunkCount, py::arg("sequence"), py::arg("layer"),
           "Chunk indices sealed in one layer (chunk i covers tokens n_sink + i*chunk_size onwards).")
      .def("wait_for_durable", &PyStore::WaitForDurable);

  py::class_<PySession, std::shared_ptr<PySession>>(
      m, "Session",
      "One sequence over a Store (include/kvtier/session.h). A context manager: "
      "`with kvtier.Session.open(store) as s:` closes the sequence at the end of the block.")
      .def_static("open", &PySession::Open, py::arg("store"), session_doc.c_str())
      .def_static("attach", &PySession::Attach, py::arg("store"), py::arg("sequence"),
                  "Session.attach(store, sequence, **options): a session over an existing sequence.")
      .def_property_readonly("sequence", &PySession::Sequence)
      .def_property_readonly("store", &PySession::store)
      .def_property_readonly("options", &PySession::Options)
      .def_property_readonly("last_chunks", &PySession::LastChunks)
      .def("append", &PySession::Append, py::arg("layer"), py::arg("k"), py::arg("v"),
           "K and V [n, kv_heads, head_dim] in the store's dtype, C-contiguous, on the CPU (read in place).")
      .def("begin_step", &PySession::BeginStep, py::arg("kind"), "'prefill' or 'decode'.")
      .def("attend", &PySession::Attend, py::arg("layer"), py::arg("q"), py::arg("positions"), py::arg("out"),
           "q [m, q_heads, head_dim] float32, positions [m] int64 (or the first position as an int): the "
           "layer's last m appended tokens (kvtier/session.h); writes out [m, q_heads, head_dim] float32 in "
           "place; returns the AttendStats as a dict.")
      .def("gather", &PySession::Gather, py::arg("layer"), py::arg("q"), py::arg("positions"))
      .def("observe", &PySession::Observe, py::arg("layer"), py::arg("q"), py::arg("positions"))
      .def("set_question", &PySession::SetQuestion, py::arg("layer"), py::arg("q"))
      .def("compress", &PySession::Compress, py::arg("policy"), py::arg("kv_budget"),
           py::arg("n_queries") = 0)
      .def("counters", &PySession::Counters, "SessionCounters as a dict.")
      .def("close", &PySession::Close, "Persists sinks and local window; the sequence becomes read-only.")
      .def("drop", &PySession::Drop, "Removes the sequence; every later call raises FailedPrecondition.")
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__", [](PySession& s, const py::args&) { s.Exit(); },
          "Closes the sequence unless close() or drop() ran already or the store was closed.");
}
