// kvtier._kvtier: the engine API (include/kvtier/kvtier.h) for Python, with pybind11.
//
// Arrays cross without copies: an argument is read through the buffer protocol (numpy) or,
// failing that, DLPack (torch tensors, on the CPU), and the pointer handed to the store or
// the attention kernel is the caller's memory. Every shape, dtype, contiguity and device is
// checked here first, so bad input raises instead of reaching C++ with a wrong extent.
// Session.append and Session.attend also take CUDA arrays (DLPack on kDLCUDA, or
// __cuda_array_interface__) on a store whose hot tier is "cuda": they go to AppendDevice and
// AttendDevice, ordered on the caller's stream (the `stream=` keyword; see DeviceView).
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
#include <utility>
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

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "offload/device_memory_cuda.h"
#include "offload/device_sync_cuda.h"
#endif

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

// DLPack's device types that this binding tells apart (dlpack.h DLDeviceType).
constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

// A DLPack dtype in numpy's words, for messages.
std::string DlpackName(const DLDataType& t) {
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

Elem DlpackElem(const DLDataType& t) {
  if (t.lanes != 1) return Elem::kOther;
  if (t.code == 2 && t.bits == 32) return Elem::kF32;
  if (t.code == 2 && t.bits == 16) return Elem::kF16;
  if (t.code == 4 && t.bits == 16) return Elem::kBF16;
  if (t.code == 0 && t.bits == 64) return Elem::kI64;
  return Elem::kOther;
}

// An array argument, whichever protocol it came through: data pointer, element type, shape,
// and the argument's name for messages. Owns the DLPack tensor it took, if any (its deleter
// runs when the view goes away).
class ArrayBase {
 public:
  virtual ~ArrayBase() { ReleaseDlpack(); }
  ArrayBase(const ArrayBase&) = delete;
  ArrayBase& operator=(const ArrayBase&) = delete;

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

 protected:
  explicit ArrayBase(const char* name) : name_(name) {}

  // Takes the tensor out of a __dlpack__ capsule: the consumer owns it from here, so the
  // capsule is renamed (its destructor then leaves it alone) and the deleter runs in
  // ReleaseDlpack.
  const DLTensor& TakeDlpack(const py::object& capsule) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    if (managed == nullptr) {
      PyErr_Clear();
      Bad(name_ + ": __dlpack__ did not return a DLPack capsule");
    }
    PyCapsule_SetName(capsule.ptr(), "used_dltensor");
    managed_ = managed;
    return managed->dl_tensor;
  }

  // Shape, dtype, data pointer and the row-major check of a DLPack tensor.
  void ReadDlTensor(const DLTensor& t) {
    shape_.assign(t.shape, t.shape + t.ndim);
    dtype_name_ = DlpackName(t.dtype);
    elem_ = DlpackElem(t.dtype);
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

  void ReleaseDlpack() {
    if (managed_ != nullptr && managed_->deleter != nullptr) managed_->deleter(managed_);
    managed_ = nullptr;
  }

  int64_t Elements() const {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    return n;
  }

  std::string name_;
  void* data_ = nullptr;
  Elem elem_ = Elem::kOther;
  std::string dtype_name_ = "an unknown dtype";  // the caller's, in numpy's words, for messages
  std::vector<int64_t> shape_;

 private:
  DLManagedTensor* managed_ = nullptr;
};

// A host array: the buffer protocol, or DLPack on the CPU. Holds the buffer until destroyed.
class ArrayView : public ArrayBase {
 public:
  ArrayView(py::handle obj, const char* name, bool writable) : ArrayBase(name) {
    try {
      if (PyObject_CheckBuffer(obj.ptr())) {
        FromBuffer(obj, writable);
      } else if (py::hasattr(obj, "__dlpack__")) {
        FromDlpack(obj);
      } else if (py::hasattr(obj, "__cuda_array_interface__")) {
        Bad(name_ +
            ": a CUDA array (__cuda_array_interface__), where this call reads a host array (numpy, or a "
            "CPU tensor)");
      } else {
        Bad(std::string(name) +
            ": expected a numpy array or a torch tensor (buffer protocol or DLPack), got " +
            std::string(py::str(py::type::of(obj).attr("__name__"))));
      }
    } catch (...) {
      Free();  // a throwing constructor runs no destructor of its own class
      throw;
    }
  }
  ~ArrayView() override { Free(); }

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

  // What makes a torch tensor unreadable in place, asked before __dlpack__ so that the message
  // says why instead of torch's own exception escaping: a tensor that requires grad (torch
  // refuses to export it), one on the meta device (no data at all), one in device memory (a
  // host array is read here). Objects without these attributes pass.
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
          "; this call reads host arrays (Session.append and Session.attend take CUDA arrays on a store "
          "with device='cuda'): move it with .cpu()");
  }

  void FromDlpack(py::handle obj) {
    CheckTorchLike(obj);
    py::object capsule;
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      Bad(name_ + ": cannot be read in place through DLPack: " + std::string(py::str(e.value())));
    }
    const DLTensor& t = TakeDlpack(capsule);
    if (t.device.device_type != kDLCPU)
      Bad(name_ + ": the tensor must be on the CPU (DLPack device type " +
          std::to_string(t.device.device_type) + "); this call reads host memory");
    ReadDlTensor(t);
  }

  void Free() {
    ReleaseDlpack();
    if (has_buffer_) PyBuffer_Release(&buffer_);
    has_buffer_ = false;
  }

  Py_buffer buffer_{};
  bool has_buffer_ = false;
};

// (device_type, device_id) from an object's __dlpack_device__(), errors naming the argument.
std::pair<int32_t, int32_t> DlpackDevice(py::handle obj, const std::string& name) {
  py::object dev;
  try {
    dev = obj.attr("__dlpack_device__")();
  } catch (py::error_already_set& e) {
    Bad(name + ": __dlpack_device__() failed: " + std::string(py::str(e.value())));
  }
  try {
    auto t = dev.cast<py::tuple>();
    if (t.size() == 2) return {t[0].cast<int32_t>(), t[1].cast<int32_t>()};
  } catch (const py::cast_error&) {
  }
  Bad(name + ": __dlpack_device__() must return (device_type, device_id), got " + std::string(py::repr(dev)));
}

// Whether an argument is a device array, as its protocols say: one with the buffer protocol is
// host memory; otherwise __dlpack_device__ names the device (kDLCPU: host), and an object
// without it that has __cuda_array_interface__ is a device array. Anything else, a
// __dlpack_device__ that raises included (torch's meta tensors), is left to ArrayView (host),
// which says what makes it unreadable.
bool IsDeviceArray(py::handle obj) {
  if (PyObject_CheckBuffer(obj.ptr())) return false;
  if (py::hasattr(obj, "__dlpack_device__")) {
    try {
      const auto dev = obj.attr("__dlpack_device__")().cast<py::tuple>();
      return dev.size() == 2 && dev[0].cast<int32_t>() != kDLCPU;
    } catch (const py::error_already_set&) {
      return false;
    } catch (const py::cast_error&) {
      return false;
    }
  }
  return py::hasattr(obj, "__cuda_array_interface__");
}

// The caller's stream, as the Python calls take it (`stream=`): a cudaStream_t's value as an
// int (torch.cuda.Stream.cuda_stream, cupy's Stream.ptr), None or 0 for the legacy default
// stream. 1 and 2 are CUDA's cudaStreamLegacy and cudaStreamPerThread handles.
int64_t StreamHandle(py::handle stream) {
  if (stream.is_none()) return 0;
  if (!PyLong_Check(stream.ptr()) || PyBool_Check(stream.ptr()))
    Bad("stream: must be an int (a cudaStream_t's value, e.g. torch.cuda.Stream.cuda_stream) or None, got " +
        std::string(py::str(py::type::of(stream).attr("__name__"))));
  const int64_t h = stream.cast<int64_t>();
  if (h < 0) Bad("stream: a cudaStream_t's value is not negative (got " + std::to_string(h) + ")");
  return h;
}

// Stream handles that name the same stream compare equal: the legacy default stream is 0 or 1
// (CUDA's cudaStreamLegacy). HIP-CPU, which runs the emulated device, has one default stream,
// which 0, 1 and 2 all name there.
int64_t SameStreamKey(int64_t handle) {
#if KVTIER_GPU_EMULATION
  return handle <= 2 ? 0 : handle;
#else
  return handle == 1 ? 0 : handle;
#endif
}

// Where a session's device calls run: the store's CUDA device and the caller's stream.
struct DeviceContext {
  int device = 0;             // the CUDA device of the store's hot tier
  int64_t stream_handle = 0;  // the caller's stream (StreamHandle)
  void* stream = nullptr;     // the same as AppendDevice/AttendDevice take it (a cudaStream_t)
};

void* StreamPointer(int64_t handle) {
  if (SameStreamKey(handle) == 0) return nullptr;
  return reinterpret_cast<void*>(static_cast<intptr_t>(handle));
}

// A device array: DLPack on a CUDA device (preferred when an object has both protocols: it
// carries the stream handshake and the memory's owner), or __cuda_array_interface__ v2/v3.
// After construction the caller's stream (ctx) is ordered after the array's producer:
//   DLPack: __dlpack__(stream=) is called with the caller's stream (1 for the legacy default
//     stream, as DLPack reserves 0), and the producer orders its pending writes before it.
//   __cuda_array_interface__ v3 `stream`: absent or None promises nothing to wait for; 1 and 2
//     are the legacy and per-thread default streams; 0 is refused (the interface reserves it);
//     another int is a cudaStream_t. Unless it is the caller's own stream, an event recorded on
//     it is what the caller's stream waits for: ordered on the device, the host does not wait.
// Refused by name: another device type (pinned host memory, kDLCUDAHost, included), a CUDA
// device other than the store's, a non-contiguous or masked array, a read-only output and, where
// the runtime can tell (cudaPointerGetAttributes, CUDA builds), host memory behind the interface.
// HIP-CPU (the emulated device) has no pointer attributes: its device memory is host memory,
// so there only what the protocols claim is checked.
class DeviceView : public ArrayBase {
 public:
  DeviceView(py::handle obj, const char* name, bool writable, const DeviceContext& ctx) : ArrayBase(name) {
#if !KVTIER_HAVE_CUDA
    (void)obj, (void)writable, (void)ctx;
    Bad(name_ + ": a CUDA array, and this build of kvtier has no CUDA");
#else
    if (py::hasattr(obj, "__dlpack_device__") && py::hasattr(obj, "__dlpack__")) {
      FromDlpack(obj, ctx);
    } else if (py::hasattr(obj, "__cuda_array_interface__")) {
      FromCudaArrayInterface(obj, writable, ctx);
    } else {
      Bad(name_ + ": expected a CUDA array (DLPack on a CUDA device, or __cuda_array_interface__), got " +
          std::string(py::str(py::type::of(obj).attr("__name__"))));
    }
    if (Elements() > 0) CheckPointer(ctx);
#endif
  }

 private:
#if KVTIER_HAVE_CUDA
  void CheckDevice(int32_t type, int32_t id, const DeviceContext& ctx) const {
    if (type == kDLCUDAHost)
      Bad(name_ +
          ": pinned host memory (DLPack device kDLCUDAHost); the device calls read CUDA device memory");
    if (type != kDLCUDA && type != kDLCUDAManaged)
      Bad(name_ + ": on DLPack device type " + std::to_string(type) +
          "; the device calls read CUDA device memory (kDLCUDA = 2)");
    if (id != ctx.device)
      Bad(name_ + ": on CUDA device " + std::to_string(id) + "; the store's hot tier is on device " +
          std::to_string(ctx.device));
  }

  void FromDlpack(py::handle obj, const DeviceContext& ctx) {
    const auto [type, id] = DlpackDevice(obj, name_);
    CheckDevice(type, id, ctx);
    const int64_t consumer = ctx.stream_handle == 0 ? 1 : ctx.stream_handle;
    py::object capsule;
    try {
      capsule = obj.attr("__dlpack__")(py::arg("stream") = consumer);
    } catch (py::error_already_set& e) {
      Bad(name_ + ": cannot be read in place through DLPack: " + std::string(py::str(e.value())));
    }
    const DLTensor& t = TakeDlpack(capsule);
    if (t.device.device_type != type || t.device.device_id != id)
      Bad(name_ + ": __dlpack__ gave a tensor on DLPack device (" + std::to_string(t.device.device_type) +
          ", " + std::to_string(t.device.device_id) + "), __dlpack_device__ said (" + std::to_string(type) +
          ", " + std::to_string(id) + ")");
    ReadDlTensor(t);
  }

  // "<f4" and the like: element type, numpy's name, bytes per element.
  void ReadTypestr(const std::string& typestr, int64_t* itemsize) {
    if (typestr.size() < 3) Bad(name_ + ": __cuda_array_interface__ typestr '" + typestr + "' is malformed");
    const char order = typestr[0], kind = typestr[1];
    int64_t bytes = 0;
    try {
      bytes = std::stoll(typestr.substr(2));
    } catch (const std::exception&) {
      Bad(name_ + ": __cuda_array_interface__ typestr '" + typestr + "' is malformed");
    }
    *itemsize = bytes;
    const std::string bits = std::to_string(bytes * 8);
    switch (kind) {
      case 'f':
        dtype_name_ = "float" + bits;
        break;
      case 'i':
        dtype_name_ = "int" + bits;
        break;
      case 'u':
        dtype_name_ = "uint" + bits;
        break;
      case 'c':
        dtype_name_ = "complex" + bits;
        break;
      case 'b':
        dtype_name_ = "bool";
        break;
      default:
        dtype_name_ = "typestr '" + typestr + "'";
    }
    if (order == '>' && bytes > 1) {
      dtype_name_ = "big-endian " + dtype_name_;
      elem_ = Elem::kOther;
    } else if (kind == 'f' && bytes == 4) {
      elem_ = Elem::kF32;
    } else if (kind == 'f' && bytes == 2) {
      elem_ = Elem::kF16;
    } else if (kind == 'i' && bytes == 8) {
      elem_ = Elem::kI64;
    } else {
      elem_ = Elem::kOther;
    }
  }

  void FromCudaArrayInterface(py::handle obj, bool writable, const DeviceContext& ctx) {
    const std::string what = name_ + ": __cuda_array_interface__";
    py::object raw;
    try {
      raw = obj.attr("__cuda_array_interface__");
    } catch (py::error_already_set& e) {
      Bad(what + " failed: " + std::string(py::str(e.value())));
    }
    if (!py::isinstance<py::dict>(raw)) Bad(what + " is not a dict");
    const auto cai = raw.cast<py::dict>();
    auto field = [&](const char* key) -> py::object {
      return cai.contains(key) ? py::reinterpret_borrow<py::object>(cai[key]) : py::none();
    };
    try {
      const py::object version = field("version");
      if (version.is_none()) Bad(what + " has no 'version'");
      const int v = version.cast<int>();
      if (v < 2 || v > 3) Bad(what + " version " + std::to_string(v) + "; kvtier reads versions 2 and 3");
      for (py::handle d : field("shape").cast<py::tuple>()) shape_.push_back(d.cast<int64_t>());
      int64_t itemsize = 0;
      ReadTypestr(field("typestr").cast<std::string>(), &itemsize);
      const auto data = field("data").cast<py::tuple>();
      if (data.size() != 2) Bad(what + " 'data' must be (pointer, read_only)");
      data_ = reinterpret_cast<void*>(static_cast<uintptr_t>(data[0].cast<uint64_t>()));
      if (writable && data[1].cast<bool>())
        Bad(name_ + ": read-only (__cuda_array_interface__ data[1] is True); the output must be writable");
      if (!field("mask").is_none()) Bad(what + " has a mask; masked arrays are not read");
      const py::object strides = field("strides");
      if (!strides.is_none()) {
        const auto s = strides.cast<py::tuple>();
        if (s.size() != shape_.size()) Bad(what + " 'strides' and 'shape' differ in length");
        int64_t expect = itemsize;
        for (size_t i = shape_.size(); i-- > 0;) {
          if (shape_[i] != 1 && s[i].cast<int64_t>() != expect)
            Bad(name_ +
                ": the array must be C-contiguous (row-major); __cuda_array_interface__ strides are " +
                std::string(py::str(strides)));
          expect *= shape_[i];
        }
      }
      const py::object stream = field("stream");
      if (v >= 3 && !stream.is_none()) OrderAfter(stream.cast<int64_t>(), ctx);
    } catch (const py::cast_error& e) {
      Bad(what + " has a field of the wrong type (" + e.what() + ")");
    }
  }

  // The caller's stream waits for the producer's (CUDA's rule for the interface's `stream`).
  void OrderAfter(int64_t producer, const DeviceContext& ctx) const {
    if (producer == 0)
      Bad(name_ +
          ": __cuda_array_interface__ stream 0 is not allowed (the interface reserves it: use 1 for the "
          "legacy default stream)");
    if (SameStreamKey(producer) == SameStreamKey(ctx.stream_handle)) return;
    cudaEvent_t event = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (e == cudaSuccess) {
      e = cudaEventRecord(event, static_cast<cudaStream_t>(StreamPointer(producer)));
      if (e == cudaSuccess) e = cudaStreamWaitEvent(static_cast<cudaStream_t>(ctx.stream), event, 0);
      (void)cudaEventDestroy(event);  // released by the runtime once the wait is done
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      Bad(name_ + ": cannot order the call after __cuda_array_interface__ stream " +
          std::to_string(producer) + ": " + cudaGetErrorString(e));
    }
  }

  void CheckPointer(const DeviceContext& ctx) const {
    if (data_ == nullptr) Bad(name_ + ": a null data pointer");
#if KVTIER_GPU_EMULATION
    // HIP-CPU has no hipPointerGetAttributes (its device memory is host memory): nothing to ask.
    (void)ctx;
#else
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, data_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      Bad(name_ + ": cudaPointerGetAttributes refused the pointer (" + cudaGetErrorString(e) + ")");
    }
    if (attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeUnregistered)
      Bad(name_ + ": host memory behind a device interface (cudaPointerGetAttributes: " +
          (attr.type == cudaMemoryTypeHost ? "pinned host memory" : "memory CUDA did not allocate") +
          "); the device calls read CUDA device memory");
    if (attr.device != ctx.device)
      Bad(name_ + ": on CUDA device " + std::to_string(attr.device) + "; the store's hot tier is on device " +
          std::to_string(ctx.device));
#endif
  }
#endif  // KVTIER_HAVE_CUDA
};

// The calling thread's current CUDA device (0 without CUDA, and on HIP-CPU's single device).
int CurrentCudaDevice() {
#if KVTIER_HAVE_CUDA && !KVTIER_GPU_EMULATION
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return device;
#else
  return 0;
#endif
}

// Which device runtime this build has: "cuda", "emulated" (HIP-CPU) or "none".
const char* DeviceRuntime() {
#if KVTIER_GPU_EMULATION
  return "emulated";
#elif KVTIER_HAVE_CUDA
  return "cuda";
#else
  return "none";
#endif
}

// kvtier.DeviceArray: a C-contiguous array in CUDA device memory that the module allocates
// (counted as DeviceMemoryOwner::kEngineArrays) and frees when the object is collected (or when the last
// DLPack consumer of it lets go). It exposes both device protocols: __cuda_array_interface__ v3 (stream None)
// and
// __dlpack__/__dlpack_device__ (kDLCUDA). It has no stream of its own: from_host's copy is
// complete when it returns, and whoever writes it on a stream (AttendDevice's out) orders its
// readers on that stream; __dlpack__ therefore has nothing to order and ignores `stream`.
// to_host() waits for the whole device (cudaDeviceSynchronize), then copies. Builds without
// CUDA raise kvtier.Unavailable on construction.
class PyDeviceArray {
 public:
  PyDeviceArray(const std::vector<int64_t>& shape, const py::object& dtype)
      : shape_(shape), dtype_(py::dtype::from_args(dtype)) {
    elem_ = NumpyElem(dtype_);
    if (elem_ != Elem::kF32 && elem_ != Elem::kF16 && elem_ != Elem::kI64)
      Bad("DeviceArray: dtype must be float32, float16 or int64, got " + std::string(py::str(dtype_)));
    for (int64_t d : shape_)
      if (d < 0) Bad("DeviceArray: shape " + ShapeText() + " has a negative dimension");
    bytes_ = static_cast<size_t>(dtype_.itemsize());
    for (int64_t d : shape_) bytes_ *= static_cast<size_t>(d);
#if KVTIER_HAVE_CUDA
    device_ = CurrentCudaDevice();
    // One byte for an empty array, so that every DeviceArray has a device pointer of its own.
    const cudaError_t e =
        device_memory::Malloc(&ptr_, std::max<size_t>(bytes_, 1), DeviceMemoryOwner::kEngineArrays);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      ptr_ = nullptr;
      Throw(ResourceExhausted("DeviceArray: cudaMalloc of " + std::to_string(bytes_) +
                              " bytes failed: " + cudaGetErrorString(e)));
    }
#else
    Throw(
        Unavailable("DeviceArray: this build of kvtier has no CUDA (build it with KVTIER_CUDA=on, or the "
                    "emulated device of make test-gpu-emulated)"));
#endif
  }
  ~PyDeviceArray() {
#if KVTIER_HAVE_CUDA
    if (ptr_ != nullptr) (void)device_memory::Free(ptr_);
#endif
  }
  PyDeviceArray(const PyDeviceArray&) = delete;
  PyDeviceArray& operator=(const PyDeviceArray&) = delete;

  // A device copy of a host array (anything numpy.ascontiguousarray takes).
  static std::unique_ptr<PyDeviceArray> FromHost(const py::object& host) {
    const auto arr = py::array::ensure(host, py::array::c_style);
    if (!arr)
      Bad("DeviceArray.from_host: expected an array, got " +
          std::string(py::str(py::type::of(host).attr("__name__"))));
    std::vector<int64_t> shape(arr.shape(), arr.shape() + arr.ndim());
    auto d = std::make_unique<PyDeviceArray>(shape, arr.dtype());
#if KVTIER_HAVE_CUDA
    if (d->bytes_ > 0) d->Copy(d->ptr_, arr.data(), cudaMemcpyHostToDevice);
#endif
    return d;
  }

  // A host copy (numpy), after every device call in flight has finished.
  py::array ToHost() const {
    py::array out(dtype_, shape_);
#if KVTIER_HAVE_CUDA
    if (bytes_ > 0) {
      const cudaError_t e = device_sync::SyncDevice();
      if (e != cudaSuccess)
        Throw(Internal(std::string("DeviceArray.to_host: cudaDeviceSynchronize: ") + cudaGetErrorString(e)));
      Copy(out.mutable_data(), ptr_, cudaMemcpyDeviceToHost);
    }
#endif
    return out;
  }

  py::tuple Shape() const { return py::cast(shape_); }
  const py::dtype& Dtype() const { return dtype_; }
  size_t Nbytes() const { return bytes_; }
  uintptr_t Pointer() const { return reinterpret_cast<uintptr_t>(ptr_); }
  int device() const { return device_; }

  py::dict CudaArrayInterface() const {
    py::dict d;
    d["shape"] = Shape();
    d["typestr"] = std::string(elem_ == Elem::kF32 ? "<f4" : elem_ == Elem::kF16 ? "<f2" : "<i8");
    d["data"] = py::make_tuple(Pointer(), false);
    d["version"] = 3;
    d["strides"] = py::none();
    d["stream"] = py::none();
    return d;
  }

  py::tuple DlpackDeviceTuple() const { return py::make_tuple(kDLCUDA, device_); }

  // A DLPack capsule ("dltensor") over this array; the tensor keeps the DeviceArray alive.
  static py::capsule Dlpack(const py::object& self) {
    const auto& a = self.cast<const PyDeviceArray&>();
    auto* holder = new DlpackHolder{};
    holder->owner = self;
    holder->shape = a.shape_;
    DLTensor& t = holder->managed.dl_tensor;
    t.data = a.ptr_;
    t.device = DLDevice{kDLCUDA, a.device_};
    t.ndim = static_cast<int32_t>(a.shape_.size());
    t.dtype = a.elem() == Elem::kF32   ? DLDataType{2, 32, 1}
              : a.elem() == Elem::kF16 ? DLDataType{2, 16, 1}
                                       : DLDataType{0, 64, 1};
    t.shape = holder->shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    holder->managed.manager_ctx = holder;
    holder->managed.deleter = [](DLManagedTensor* m) {
      py::gil_scoped_acquire gil;
      delete static_cast<DlpackHolder*>(m->manager_ctx);
    };
    return py::capsule(&holder->managed, "dltensor", [](PyObject* capsule) {
      // Still named "dltensor": no consumer took the tensor, so the capsule frees it.
      if (PyCapsule_IsValid(capsule, "dltensor")) {
        auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
        m->deleter(m);
      }
    });
  }

  Elem elem() const { return elem_; }

 private:
  struct DlpackHolder {
    DLManagedTensor managed{};
    py::object owner;
    std::vector<int64_t> shape;
  };

  static Elem NumpyElem(const py::dtype& dt) {
    if (dt.kind() == 'f' && dt.itemsize() == 4) return Elem::kF32;
    if (dt.kind() == 'f' && dt.itemsize() == 2) return Elem::kF16;
    if (dt.kind() == 'i' && dt.itemsize() == 8) return Elem::kI64;
    return Elem::kOther;
  }

  std::string ShapeText() const {
    std::string s = "(";
    for (size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
    return s + ")";
  }

#if KVTIER_HAVE_CUDA
  void Copy(void* dst, const void* src, cudaMemcpyKind kind) const {
    const cudaError_t e = device_sync::CopyBlocking(dst, src, bytes_, kind);
    if (e != cudaSuccess) Throw(Internal(std::string("DeviceArray: cudaMemcpy: ") + cudaGetErrorString(e)));
  }
#endif

  std::vector<int64_t> shape_;
  py::dtype dtype_;
  Elem elem_ = Elem::kOther;
  size_t bytes_ = 0;
  void* ptr_ = nullptr;
  int device_ = 0;
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
    if (o.device == Device::kCuda) cuda_device_ = CurrentCudaDevice();
  }
  // The CUDA device a "cuda" hot tier was opened on: the caller's current device then.
  int cuda_device() const { return cuda_device_; }
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
  int cuda_device_ = 0;
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

  // Host arrays go to Append; device arrays (both k and v) to AppendDevice on `stream`.
  void Append(int64_t layer, py::handle k, py::handle v, py::handle stream) {
    CheckLayer(layer);
    if (DeviceCall({{k, "k"}, {v, "v"}})) {
      const DeviceContext ctx = DeviceCallContext("k", stream);
      DeviceView kv(k, "k", false, ctx), vv(v, "v", false, ctx);
      const int n = CheckKv(kv, vv);
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      Check(s().AppendDevice(static_cast<int>(layer), kv.data(), vv.data(), n, g().dtype, ctx.stream));
      return;
    }
    NoStreamForHostArrays(stream, "k and v");
    ArrayView kv(k, "k", false), vv(v, "v", false);
    const int n = CheckKv(kv, vv);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().Append(static_cast<int>(layer), kv.data(), vv.data(), n, g().dtype));
  }

  // Shapes and dtypes of K and V; the number of tokens.
  int CheckKv(const ArrayBase& kv, const ArrayBase& vv) const {
    const Geometry& geo = g();
    for (const ArrayBase* a : {&kv, &vv}) {
      a->Expect(ElemOf(geo.dtype), 3);
      a->ExpectDim(1, geo.kv_heads, "kv_heads");
      a->ExpectDim(2, geo.head_dim, "head_dim");
    }
    if (kv.dim(0) != vv.dim(0))
      Bad("k and v must hold the same number of tokens (" + kv.ShapeString() + " vs " + vv.ShapeString() +
          ")");
    return CheckedInt(kv.dim(0), "tokens");
  }

  // Whether a call's arrays are device arrays: all of them, or none (a mix is refused, naming
  // the host one).
  static bool DeviceCall(std::initializer_list<std::pair<py::handle, const char*>> arrays) {
    int device = 0;
    const char* a_device = nullptr;
    const char* a_host = nullptr;
    for (const auto& [obj, name] : arrays) {
      if (IsDeviceArray(obj)) {
        ++device;
        a_device = name;
      } else {
        a_host = name;
      }
    }
    if (device > 0 && a_host != nullptr)
      Bad(std::string(a_host) + ": a host array beside the device array " + a_device +
          "; pass them all in device memory or all in host memory");
    return device > 0;
  }

  static void NoStreamForHostArrays(py::handle stream, const char* arrays) {
    if (!stream.is_none())
      Bad("stream: is for device arrays, and " + std::string(arrays) + " are host arrays");
  }

  // The store's CUDA device and the caller's stream, for a device call; refused on a host tier.
  DeviceContext DeviceCallContext(const char* first_array, py::handle stream) const {
    if (ImplOf(s()).store()->hot_tier()->device() != Device::kCuda)
      Bad(std::string(first_array) +
          ": a CUDA array, and this session's store has its hot tier on the host: device arrays need a store "
          "opened with device='cuda'"
#if !KVTIER_HAVE_CUDA
          " (and a build of kvtier with CUDA)"
#endif
      );
    DeviceContext ctx;
    ctx.device = store_.cast<const PyStore&>().cuda_device();
    ctx.stream_handle = StreamHandle(stream);
    ctx.stream = StreamPointer(ctx.stream_handle);
    return ctx;
  }

  void BeginStep(const std::string& kind) {
    const StepKind k = ParseStep(kind);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Check(s().BeginStep(k));
  }

  // q [m, q_heads, head_dim] f32 and positions [m] int64 (or the first position as an int).
  struct Queries {
    std::unique_ptr<ArrayBase> q;
    std::unique_ptr<ArrayView> pos;
    std::vector<int64_t> own_pos;
    const int64_t* positions = nullptr;
    int m = 0;
  };
  Queries ReadQueries(py::handle q, py::handle positions) const {
    return ReadQueries(std::make_unique<ArrayView>(q, "q", false), positions);
  }
  Queries ReadQueries(std::unique_ptr<ArrayBase> q, py::handle positions) const {
    Queries r;
    r.q = std::move(q);
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

  // Host q and out go to Attend; device q and out (positions stay on the host) to AttendDevice
  // on `stream`.
  py::dict Attend(int64_t layer, py::handle q, py::handle positions, py::handle out, py::handle stream) {
    CheckLayer(layer);
    AttendStats stats;
    if (DeviceCall({{q, "q"}, {out, "out"}})) {
      if (IsDeviceArray(positions))
        Bad("positions: a device array; positions are read on the host (an int, or a host int64 array)");
      const DeviceContext ctx = DeviceCallContext("q", stream);
      auto qv = std::make_unique<DeviceView>(q, "q", false, ctx);
      Queries qs = ReadQueries(std::move(qv), positions);
      DeviceView ov(out, "out", true, ctx);
      CheckOut(qs, ov);
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      Check(s().AttendDevice(static_cast<int>(layer), static_cast<const float*>(qs.q->data()), qs.positions,
                             qs.m, static_cast<float*>(ov.data()), ctx.stream, &stats));
    } else {
      NoStreamForHostArrays(stream, "q and out");
      Queries qs = ReadQueries(q, positions);
      ArrayView ov(out, "out", true);
      CheckOut(qs, ov);
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      Check(s().Attend(static_cast<int>(layer), static_cast<const float*>(qs.q->data()), qs.positions, qs.m,
                       static_cast<float*>(ov.data()), &stats));
    }
    return StatsDict(stats);
  }

  // out [m, q_heads, head_dim] float32, not overlapping q.
  void CheckOut(const Queries& qs, const ArrayBase& ov) const {
    ov.Expect(Elem::kF32, 3);
    ov.ExpectDim(0, qs.m, "queries");
    ov.ExpectDim(1, g().q_heads, "q_heads");
    ov.ExpectDim(2, g().head_dim, "head_dim");
    const auto* qp = static_cast<const char*>(qs.q->data());
    const auto* op = static_cast<const char*>(ov.data());
    const size_t bytes = static_cast<size_t>(qs.m) * g().q_heads * g().head_dim * sizeof(float);
    if (qp < op + bytes && op < qp + bytes) Bad("out must not overlap q");
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
    d["chunks_deferred"] = c.chunks_deferred;
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
    d["worker_host_syncs"] = c.worker_host_syncs;
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
  // A decode step on the device lane names its chunks one step late: the property reads what
  // the lane still holds first (Session::WaitForDevice; no wait when nothing is pending).
  std::vector<std::vector<uint64_t>> LastChunks() const {
    Check(s().WaitForDevice());
    return s().last_chunks();
  }
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

  m.def("device_runtime", &DeviceRuntime,
        "The device runtime of this build: 'cuda', 'emulated' (the CUDA sources on HIP-CPU) or 'none'.");
  py::class_<PyDeviceArray>(
      m, "DeviceArray",
      "A C-contiguous array in CUDA device memory, allocated by kvtier and freed when "
      "collected: for Session.append/attend on a store with device='cuda'. Exposes "
      "__cuda_array_interface__ (v3) and __dlpack__/__dlpack_device__ (kDLCUDA). Builds "
      "without CUDA raise kvtier.Unavailable.")
      .def(py::init<const std::vector<int64_t>&, const py::object&>(), py::arg("shape"),
           py::arg("dtype") = "float32", "Uninitialised device memory; dtype float32, float16 or int64.")
      .def_static("from_host", &PyDeviceArray::FromHost, py::arg("array"),
                  "A device copy of a host array (numpy; complete on return).")
      .def("to_host", &PyDeviceArray::ToHost,
           "A numpy copy, once every device call in flight has finished (cudaDeviceSynchronize).")
      .def_property_readonly("shape", &PyDeviceArray::Shape)
      .def_property_readonly("dtype", &PyDeviceArray::Dtype)
      .def_property_readonly("nbytes", &PyDeviceArray::Nbytes)
      .def_property_readonly("ptr", &PyDeviceArray::Pointer, "The device pointer, as an int.")
      .def_property_readonly("device", &PyDeviceArray::device, "The CUDA device id.")
      .def_property_readonly("__cuda_array_interface__", &PyDeviceArray::CudaArrayInterface)
      .def("__dlpack_device__", &PyDeviceArray::DlpackDeviceTuple)
      .def(
          "__dlpack__",
          [](const py::object& self, const py::object& /*stream*/, const py::object& /*max_version*/) {
            return PyDeviceArray::Dlpack(self);
          },
          py::kw_only(), py::arg("stream") = py::none(), py::arg("max_version") = py::none(),
          "A DLPack capsule (kDLCUDA). `stream` is accepted and ignored: the array has no pending writes of "
          "its own to order (see the class).");

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
      .def(
          "append", &PySession::Append, py::arg("layer"), py::arg("k"), py::arg("v"), py::kw_only(),
          py::arg("stream") = py::none(),
          "K and V [n, kv_heads, head_dim] in the store's dtype, C-contiguous, read in place: host arrays, "
          "or "
          "on a store with device='cuda' CUDA arrays (DLPack or __cuda_array_interface__) appended device to "
          "device, ordered on `stream` (a cudaStream_t's value as an int; None = the legacy default stream).")
      .def("begin_step", &PySession::BeginStep, py::arg("kind"), "'prefill' or 'decode'.")
      .def("attend", &PySession::Attend, py::arg("layer"), py::arg("q"), py::arg("positions"), py::arg("out"),
           py::kw_only(), py::arg("stream") = py::none(),
           "q [m, q_heads, head_dim] float32, positions [m] int64 (or the first position as an int): the "
           "layer's last m appended tokens (kvtier/session.h); writes out [m, q_heads, head_dim] float32 in "
           "place; returns the AttendStats as a dict. q and out may be CUDA arrays on a store with "
           "device='cuda' (positions stay on the host): the attention is ordered on `stream` as append's is, "
           "and out is written on that stream.")
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
